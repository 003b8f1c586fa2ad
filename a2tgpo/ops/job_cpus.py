"""A job's CPUs against the number its study config asked for.

The workflow's train, sweep_trial, evaluate and evaluate_all rules request `train.threads` or
`eval.threads` CPUs from SLURM (the resource `cpus_per_task`) and pass the same number to the
job as A2TGPO_JOB_CPUS, with the thread-count variables (workflow/rules/common.smk,
`job_cpus_env`). A job can still get fewer: a profile's `cpus_per_task` wins over the rule's,
and a site may cap CPUs per GPU. Then 8 trainer ranks, 8 vLLM engine cores and the retrieval
server share those few cores and every rollout slows down by about that ratio, with no error
anywhere. So the job checks at start and logs one warning naming the config key; it still runs.
"""

from __future__ import annotations

import logging
import os

from a2tgpo.config import ConfigError

log = logging.getLogger(__name__)

ENV = "A2TGPO_JOB_CPUS"
# What Snakemake sets from a job's `threads` (snakemake/shell.py); the rules set them from the
# config instead, because Snakemake caps `threads` at --cores (see job_cpus_env).
THREAD_VARS = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def granted_cpus(environ: dict[str, str] | None = None,
                 affinity: set[int] | None = None) -> tuple[int, str]:
    """The CPUs this process may use, and how that was read: its CPU affinity (cgroups and
    SLURM's task binding show there), or SLURM_CPUS_PER_TASK where that is smaller (a node
    without task confinement shows all its cores in the affinity)."""
    env = os.environ if environ is None else environ
    n_aff = len(os.sched_getaffinity(0) if affinity is None else affinity)
    seen = [f"CPU affinity {n_aff}"]
    n = n_aff
    slurm = env.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        seen.append(f"SLURM_CPUS_PER_TASK={slurm}")
        n = min(n, int(slurm))
    return n, ", ".join(seen)


def check_job_cpus(key: str, environ: dict[str, str] | None = None,
                   affinity: set[int] | None = None) -> str | None:
    """Log a warning when this job has fewer CPUs than A2TGPO_JOB_CPUS (the value of config
    key `key`, e.g. "train.threads"), and return it; None when it has enough, when the variable
    is unset (a command started by hand), or on a launched rank other than local rank 0 (the
    ranks of a node share the job's CPUs, so one line says it)."""
    env = os.environ if environ is None else environ
    want = env.get(ENV)
    if want is None or env.get("LOCAL_RANK", "0") != "0":
        return None
    if not want.isdigit() or int(want) < 1:
        raise ConfigError(f"{ENV}={want!r}: expected a positive integer, the job's {key}")
    have, seen = granted_cpus(env, affinity)
    if have >= int(want):
        return None
    msg = (f"{key} = {want} asks for {want} CPUs, but this job has {have} ({seen}): its "
           f"processes share {have} cores and run slower. Give the rule {want} CPUs (SLURM "
           f"--cpus-per-task; a profile's cpus_per_task wins over the config) or set {key} "
           f"to what the nodes give.")
    log.warning(msg)
    return msg
