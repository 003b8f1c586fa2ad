"""Time limits and preemption: a stop request, the safe points that act on it, the job's deadline.

SLURM warns a job before ending it: the profile asks for SIGTERM `--signal=TERM@N` seconds
before the time limit, and a preemption or `scontrol requeue` sends SIGTERM, then SIGKILL after
the cluster's KillWait (or the partition's GraceTime). SIGTERM, not SIGUSR1: it reaches every
process of the job step, and the ones between SLURM and the trainer (Snakemake's job process,
`a2tgpo with-retriever`, `a2tgpo launch`) survive SIGTERM and wait for their children, while
Snakemake dies on SIGUSR1 and takes the job with it. SIGUSR1 is still honoured (a user's own
batch script may forward it).

`PreemptionHandler` turns both into this process's stop request. The trainer acts on it at
safe points (rl.py):

  - between rollout waves: `check_stop()` at the start of every wave raises `StopRequested`;
    the ranks agree (a sum over ranks after their rollouts) and abandon the step, whose
    partial rollouts are all that is lost; the run saves the state the step started from
    (weights, optimizer and data order untouched; RNG states restored from the step's start)
  - during validation's waves: the same; the step's checkpoint is saved with its validation
    pending, which the resumed run does first
  - after the log-prob passes and updates of a step: they run to the end (minutes at most,
    with no way back to the step's start), then the step is saved

then exits with `EXIT_PREEMPTED`, and the rerun resumes from that checkpoint with the same
result as a run never interrupted.

The time budget needs no signal: under SLURM, `TimeBudget` reads the job's end time, and the
trainer stops the same way before a step that would not end `stop_margin_s` before it (the
estimate: the longest recent step plus the last save).
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL, "try again later": distinct from success (0), Python errors (1) and
# usage errors (2), so the caller (Snakemake retries, a SLURM requeue script) can tell a
# preempted run, which a plain rerun resumes, from a failed one.
EXIT_PREEMPTED = 75

_requests: list[str] = []  # this process's stop request: the signals received, in order


class StopRequested(Exception):
    """Raised at a safe point once a stop was requested."""


def request_stop(reason: str) -> None:
    _requests.append(reason)


def stop_requested() -> bool:
    return bool(_requests)


def check_stop() -> None:
    """A safe point: raise `StopRequested` if a stop was requested."""
    if _requests:
        raise StopRequested(f"stop requested ({_requests[0]})")


class PreemptionHandler:
    """Turn SIGTERM / SIGUSR1 into this process's stop request, instead of dying.

        with PreemptionHandler() as preempt:
            for step in ...:
                train_step()
                if preempt.requested:
                    save_checkpoint(...)
                    sys.exit(EXIT_PREEMPTED)

    Save inside the `with` block: further signals then only add to the request, so they cannot
    interrupt the save. The previous handlers are restored, and the request cleared, on exit.
    Must be entered from the main thread (a Python restriction on signal handlers).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        self.signals = tuple(signals)
        self.received: list[str] = []
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return stop_requested()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not _requests:
            log.warning("received %s: will checkpoint and exit at the next safe point", name)
        self.received.append(name)
        request_stop(name)

    def __enter__(self) -> PreemptionHandler:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        _requests.clear()


# --------------------------------------------------------------------------------------------
# the anchor: a job ends with the Snakemake that started it

# "<host>:<pid>:<start time>" of the process whose end ends this one's job. The workflow sets
# it to Snakemake's own (workflow/rules/common.smk) and every process of a job inherits it, so a
# killed Snakemake leaves no orphans: each a2tgpo process of its jobs gets SIGTERM, and a
# trainer checkpoints at its next safe point and exits, releasing its run folder.
ANCHOR_ENV = "A2TGPO_ANCHOR"
ANCHOR_POLL_S = 2.0


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), None if
    it has ended (or is a zombie). With the pid it names one process: pids are reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 3
    return None if fields[0] in ("Z", "X") else fields[19]


def anchor_value(pid: int | None = None) -> str:
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def anchor_alive(value: str) -> bool | None:
    """Whether the anchor process still runs; None where this host cannot tell (another host's
    process, a malformed value, no /proc)."""
    try:
        host, pid, start = value.rsplit(":", 2)
        pid_n = int(pid)
    except ValueError:
        return None
    if host != socket.gethostname() or start == "None" or not Path("/proc").is_dir():
        return None
    return _start_time(pid_n) == start


def watch_anchor(sig: signal.Signals = signal.SIGTERM, *, poll_s: float = ANCHOR_POLL_S,
                 environ: dict[str, str] | None = None) -> threading.Thread | None:
    """Send `sig` to this process once the $A2TGPO_ANCHOR process has ended (a daemon thread
    polling every `poll_s`); None (no watch) without an anchor this host can see."""
    value = (os.environ if environ is None else environ).get(ANCHOR_ENV, "")
    if not value or not anchor_alive(value):  # None: not visible here; False: gone already,
        return None                           # and this job was started on purpose after it

    def watch() -> None:
        while anchor_alive(value):
            time.sleep(poll_s)
        log.warning("the process that started this job (%s) has ended: sending %s to "
                    "myself (pid %d) so the job stops rather than running on unseen",
                    value, signal.Signals(sig).name, os.getpid())
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=watch, name="anchor-watch", daemon=True)
    thread.start()
    return thread


# --------------------------------------------------------------------------------------------
# the time budget


def job_end_time(environ: dict[str, str] | None = None) -> float | None:
    """The SLURM job's end time (epoch seconds), or None outside SLURM or without a limit.

    SLURM_JOB_END_TIME where SLURM sets it (23.02 and later), else `squeue -o %e` (the end
    time in the cluster's local time, as this node's clock reads it).
    """
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_END_TIME", "").isdigit():
        return float(env["SLURM_JOB_END_TIME"])
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
        return datetime.datetime.fromisoformat(out).timestamp()
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        log.warning("could not read the end time of SLURM job %s (%s): no time-budget "
                    "checkpoint, only the time-limit signal", job, e)
        return None


class TimeBudget:
    """Whether another step fits before the job's end: the longest of the last `window` steps
    plus the last save, `margin_s` before the end time (which is re-read every 5 minutes:
    `scontrol update TimeLimit` may move it)."""

    REREAD_S = 300.0

    def __init__(self, margin_s: float, *, end_time=job_end_time, clock=time.time,
                 window: int = 5) -> None:
        self.margin_s, self._read_end, self._clock, self.window = margin_s, end_time, clock, window
        self._end = end_time()
        self._read_at = clock()
        self.steps: list[float] = []
        self.save_s = 0.0
        if self._end is not None:
            log.info("job ends at %s: stopping with a checkpoint before a step that would end "
                     "within %.0f s of it", time.strftime("%Y-%m-%d %H:%M:%S",
                                                        time.localtime(self._end)), margin_s)

    def step_took(self, seconds: float) -> None:
        self.steps = (self.steps + [seconds])[-self.window:]

    def save_took(self, seconds: float) -> None:
        self.save_s = seconds

    def left(self) -> float | None:
        """Seconds to the job's end, None without a deadline."""
        if self._clock() - self._read_at > self.REREAD_S:
            self._end, self._read_at = self._read_end(), self._clock()
        return None if self._end is None else self._end - self._clock()

    def next_step_fits(self) -> bool:
        left = self.left()
        if left is None or not self.steps:
            return True
        return max(self.steps) + self.save_s + self.margin_s <= left
