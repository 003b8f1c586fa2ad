"""How jobs run, apart from what they compute: the operations code a reader of the method can
skip.

    preemption.py  stop requests (signals, the job's deadline, the anchor process) and the safe
                   points that act on them
    lock.py        one writer per run folder
    joblog.py      each job log's first and last lines; job_cpus.py: the CPUs a job got
    sidecar.py     a job's own retrieval server (`a2tgpo with-retriever`)
    hub.py         a read-only Hugging Face Hub for a local folder (`a2tgpo serve-hub`)
    rehearsal.py   the rehearsal: a study command run against such a hub (`a2tgpo rehearse`)

It sits low in the layer order (pyproject.toml, [tool.importlinter]), beside `algo`: rollouts,
training and evaluation check for a stop request at their safe points and lock their folders,
so they import it; it imports only `config` and `progress`. The hub's contents, built with the
pipeline's own code, are a2tgpo/rehearsal_hub.py, above training.
"""
