"""`a2tgpo launch`: start a training job's ranks on this node and keep them alive through a stop.

    a2tgpo launch --nproc 8 -- a2tgpo train CONFIG

starts COMMAND `nproc` times with the variables torch.distributed and DeepSpeed read (RANK,
LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE / LOCAL_SIZE, MASTER_ADDR, MASTER_PORT), and the job's
thread counts (OMP_NUM_THREADS, which the train rule sets to the job's CPUs, `train.threads`,
and the BLAS ones) split between them, waits for all of them, and exits with:

  - the first failing rank's status, after stopping the others (a rank that dies leaves the
    rest waiting in a collective forever): SIGTERM, then SIGKILL after `fail_grace_s`;
  - else 75 if any rank exited 75 (stopped for a time limit or preemption, resumable);
  - else 0.

SIGTERM, SIGUSR1 and SIGINT are passed on to every rank and nothing else is done about them:
the ranks checkpoint at their next safe point and exit 75 (a2tgpo/ops/preemption.py), and
SLURM's own KillWait stays the only hard limit. This is why the DAG does not use the deepspeed
launcher or torchrun: on SIGTERM both pass it on and SIGKILL the ranks 30 s later, before a
checkpoint of a multi-billion-parameter model is written.

Several nodes (`--nnodes N`, one launcher per node under srun): the node's rank is SLURM_NODEID,
the master the first host of SLURM_JOB_NODELIST, the port derived from SLURM_JOB_ID (as
`distributed.launcher_env` derives them for srun-started ranks).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from pathlib import Path

from a2tgpo.ops.preemption import EXIT_PREEMPTED
from a2tgpo.train.distributed import SLURM_PORT_BASE, SLURM_PORT_RANGE, first_slurm_host, free_port

log = logging.getLogger(__name__)

PASSED_ON = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# thread counts of the job a rank gets its share of (Snakemake sets all but the first to the
# rule's threads too); MKL's left at the job's count oversubscribed each rank's vLLM engine
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS")


def rank_envs(nproc: int, *, nnodes: int = 1, environ: dict[str, str] | None = None
              ) -> list[dict[str, str]]:
    """The environment of each local rank (the launcher's own, plus the rendezvous)."""
    env = dict(os.environ if environ is None else environ)
    if nnodes > 1:
        if "SLURM_NODEID" not in env:
            raise ValueError(f"--nnodes {nnodes} needs SLURM_NODEID (one launcher per node "
                             "under srun)")
        node = int(env["SLURM_NODEID"])
        addr = env.get("MASTER_ADDR") or first_slurm_host(env["SLURM_JOB_NODELIST"])
        port = env.get("MASTER_PORT") or str(
            SLURM_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % SLURM_PORT_RANGE)
    else:
        node, addr = 0, env.get("MASTER_ADDR", "127.0.0.1")
        port = env.get("MASTER_PORT") or str(free_port())
    world = nproc * nnodes
    # the job's CPU threads (the rule's threads: OMP_NUM_THREADS, and the BLAS variables
    # Snakemake sets for every job) shared by its ranks, instead of every rank starting that many
    per_rank = {var: str(max(1, int(env[var]) // nproc)) for var in THREAD_VARS
                if env.get(var, "").isdigit()}
    return [{**env, **per_rank, "RANK": str(node * nproc + local), "LOCAL_RANK": str(local),
             "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc), "LOCAL_SIZE": str(nproc),
             "MASTER_ADDR": addr, "MASTER_PORT": port}
            for local in range(nproc)]


def remove_shm_buffers(addr: str, port: str, shm: str = "/dev/shm") -> list[str]:
    """Delete the shared-memory all-reduce buffers DeepSpeed's CPU backend made for this
    rendezvous: `deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`, 69 MB per rank, which
    it never unlinks, so every CPU job left them in /dev/shm (RAM): 12 GB after a day of tests
    here. Only this launch's own (its address and port) are touched. Returns the names."""
    prefix = f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_"
    gone = []
    for path in Path(shm).glob(prefix + "*"):
        if path.name[len(prefix):].isdigit():
            path.unlink(missing_ok=True)
            gone.append(path.name)
    if gone:
        log.info("removed DeepSpeed's shared-memory buffers %s", gone)
    return gone


def _status(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N


def launch(command: list[str], nproc: int, *, nnodes: int = 1, fail_grace_s: float = 30.0,
           poll_s: float = 0.2) -> int:
    """Run the ranks (module docstring); returns the job's exit status."""
    if nproc < 1 or not command:
        raise ValueError(f"need nproc >= 1 and a command, got {nproc}, {command!r}")
    envs = rank_envs(nproc, nnodes=nnodes)
    procs = [subprocess.Popen(command, env=env) for env in envs]
    log.info("launched %d ranks (pids %s) of: %s", nproc, [p.pid for p in procs],
             " ".join(command))

    def pass_on(signum, _frame):
        log.warning("received %s: passed on to the ranks", signal.Signals(signum).name)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in PASSED_ON}
    failed: tuple[int, int] | None = None  # (rank, status)
    try:
        while any(p.poll() is None for p in procs):
            if failed is None:
                for rank, p in enumerate(procs):
                    code = p.poll()
                    if code is not None and code not in (0, EXIT_PREEMPTED):
                        failed = (rank, _status(code))
                        log.error("rank %d exited with status %d: stopping the others", rank,
                                  failed[1])
                        _stop_all(procs, fail_grace_s)
                        break
            time.sleep(poll_s)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        remove_shm_buffers(envs[0]["MASTER_ADDR"], envs[0]["MASTER_PORT"])
    codes = [_status(p.returncode) for p in procs]
    if failed is None:
        bad = [(r, c) for r, c in enumerate(codes) if c not in (0, EXIT_PREEMPTED)]
        failed = bad[0] if bad else None
    if failed is not None:
        return failed[1]
    status = EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0
    log.info("all %d ranks exited (%s)", nproc, "stopped, resumable" if status else "done")
    return status


def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
