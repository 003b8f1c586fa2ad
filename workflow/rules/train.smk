# Training: one resolved config per cell and one training job per cell (eval.smk selects and
# evaluates). Checkpoints are not outputs (Snakemake deletes the outputs of failed jobs): a
# failed or preempted job leaves its checkpoints, and the rerun resumes from the last one.

import json
import shlex

from a2tgpo.config import to_dict

TRAIN = STUDY.train


rule cell_config:
    """The cell's resolved TrainConfig. Its params are the resolved values, so editing the
    study config reruns exactly the cells whose settings changed (comments do not count)."""
    output:
        f"{R}/runs/{{cell}}/config.yaml",
    localrule: True
    params:
        resolved=lambda wc: json.dumps(to_dict(resolve_cell(wc.cell)), sort_keys=True),
    run:
        from a2tgpo.config import dump_config

        dump_config(resolve_cell(wildcards.cell), output[0])


rule fetch_backbone:
    """A released backbone at its pinned revision, fetched once on the submitting host
    (a2tgpo/model/fetch.py): compute nodes need no internet and load it with the hub offline.
    Its revision is a param: pinning another one fetches again and retrains its cells."""
    output:
        f"{R}/models/{{backbone}}/fetch.json",
    log:
        f"{R}/logs/fetch_backbone/{{backbone}}.log",
    localrule: True
    params:
        cfg=lambda wc: f"{STUDY.backbones_dir}/{wc.backbone}.yaml",
        out=lambda wc: study_lib.model_dir(STUDY, wc.backbone),
        revision=lambda wc: str(BACKBONES[wc.backbone].revision),
    shell:
        "a2tgpo fetch-backbone {params.cfg:q} --out {params.out:q} > {log:q} 2>&1"


rule fetch_encoder:
    """The retrieval encoder (retrieval.encoder.model given by hub id) at its revision, fetched
    once on the submitting host like the backbones; index, training and evaluation jobs load it
    from there with the hub offline."""
    output:
        f"{R}/models/encoder/fetch.json",
    log:
        f"{R}/logs/fetch_backbone/encoder.log",
    localrule: True
    params:
        repo=STUDY.retrieval.encoder.model,
        revision=(
            f" --revision {shlex.quote(STUDY.retrieval.encoder.revision)}"
            if STUDY.retrieval.encoder.revision
            else ""
        ),
        out=lambda wc: study_lib.encoder_dir(STUDY),
    shell:
        "a2tgpo fetch-model {params.repo:q}{params.revision} --out {params.out:q} > {log:q} 2>&1"


ruleorder: fetch_encoder > fetch_backbone


rule mlflow_experiment:
    """Create the study's MLflow experiment once, before parallel jobs race to create it.
    Best effort (a2tgpo.tracking.ensure_experiment): with the tracking server down it still
    succeeds, experiment.json says "created": false and the log says why, and training goes
    on; each job's tracker creates the experiment if the server is back by then. Jobs take
    this file as ancient(): it orders them after this rule, and rewriting it (this rule's code
    changed, or the file was deleted) never reruns them."""
    output:
        f"{R}/mlflow/experiment.json",
    log:
        f"{R}/logs/mlflow_experiment.log",
    localrule: True
    run:
        from a2tgpo.tracking import ensure_experiment

        ensure_experiment(
            STUDY.tracking, study=STUDY.study, results_dir=R, out=output[0], log_file=log[0]
        )


rule train:
    input:
        cfg=f"{R}/runs/{{cell}}/config.yaml",
        data=lambda wc: f"{data_dir(Cell.parse(wc.cell).data)}/summary.json",
        index=f"{R}/index/check.json",
        policy=lambda wc: policy_inputs(Cell.parse(wc.cell).backbone),
        encoder=ENCODER_INPUTS,
        mlflow=[ancient(f"{R}/mlflow/experiment.json")] if STUDY.tracking.mlflow else [],
    output:
        f"{R}/runs/{{cell}}/summary.json",
    log:
        f"{R}/logs/runs/{{cell}}/train.log",
    # enough attempts for the run at its time limit (common.smk, 4.); None: the profile's
    retries: TRAIN_RETRIES
    threads: TRAIN.threads
    resources:
        gpu=lambda wc: job_gpus(Cell.parse(wc.cell).backbone, TRAIN.nproc),
        runtime=TRAIN.runtime_min,
        mem_mb=train_mem_mb,
        # SLURM's CPUs and the thread counts from the config, not `threads`, which Snakemake
        # caps at the submitting host's cores (common.smk, job_cpus_env)
        cpus_per_task=TRAIN.threads,
    params:
        cmd=lambda wc, threads: train_command(wc, threads),
        retriever=lambda wc, input: with_retriever(input.cfg),
    # exec: no shell between Snakemake and the job, since SLURM's SIGTERM reaches every
    # process of the job step and a shell would die of it (a2tgpo/ops/preemption.py)
    shell:
        "HF_HUB_OFFLINE=1 "
        + job_cpus_env(TRAIN.threads)
        + "exec {params.retriever}{params.cmd} {input.cfg:q} > {log:q} 2>&1"
