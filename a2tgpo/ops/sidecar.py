"""A job's own retrieval server: start it on this node, run the job against it, stop it.

`retrieval.mode: http` with `retrieval.http.serve: job` makes every training and evaluation
job run as `a2tgpo with-retriever CELL_CONFIG -- COMMAND...`:

  1. the retrieval section is written with mode inprocess (the server searches itself) and
     `a2tgpo serve-retriever` starts on `retrieval.http.host`, on a free port, with a ready
     file (its own process group, and holding on through SIGTERM: SLURM's time-limit or
     preemption SIGTERM reaches every process of the job, and the trainer goes on searching
     until its next safe point; step 4 stops it with SIGINT);
  2. the job waits for the ready file, at most `retrieval.http.start_timeout_s` (loading a
     21M-passage index takes minutes); a server that exits first fails the job with the tail
     of its log, naming the index;
  3. COMMAND runs with A2TGPO_RETRIEVER_URL set to the server's URL, which the HTTP client
     uses instead of `retrieval.http.url` (`retriever.build_retriever`); SIGTERM and SIGUSR1
     (a SLURM time limit or preemption) are passed on to it, so the trainer can checkpoint;
  4. the server is stopped (SIGINT, then SIGKILL after 30 s) however COMMAND ended, and
     COMMAND's exit status is returned (75: preempted, resumable).

Why a server per job rather than one service job for all: its life follows the job through
requeues and time limits with nothing to coordinate, and a training job holds a whole node,
so this is one server per node, as the papers' setup runs it. The price is loading the index
at every job start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from a2tgpo.config import dump_config
from a2tgpo.ops.preemption import ANCHOR_ENV, anchor_value

log = logging.getLogger(__name__)

ENV_URL = "A2TGPO_RETRIEVER_URL"
STOP_GRACE_S = 30.0


class RetrieverStartError(RuntimeError):
    """The job's retrieval server did not come up."""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_server(retrieval, corpus: str, index: str | None, state_dir: Path):
    """Start `serve-retriever` for `retrieval` and wait until it listens. -> (process, url)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    section = state_dir / "retriever.yaml"
    dump_config(dataclasses.replace(retrieval, mode="inprocess"), section)
    ready = state_dir / "retriever.ready.json"
    ready.unlink(missing_ok=True)
    log_path = state_dir / "retriever.log"
    cmd = [sys.executable, "-m", "a2tgpo.cli", "serve-retriever", str(section), "--corpus",
           str(corpus), "--host", retrieval.http.host, "--port", "0", "--ready-file", str(ready),
           "--hold-on-sigterm"]
    if index is not None:
        cmd += ["--index", str(index)]
    with open(log_path, "ab") as out:
        # anchored to this process, not to the workflow's: it serves the job to its end, and
        # stops if this process is killed before it can stop the server itself
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True,
                                  env={**os.environ, ANCHOR_ENV: anchor_value()})
    log.info("retrieval server starting (pid %d, index %s, log %s)", server.pid, index,
             log_path)
    deadline = time.monotonic() + retrieval.http.start_timeout_s
    next_note = time.monotonic() + 30
    while not ready.exists():
        if server.poll() is not None:
            raise RetrieverStartError(
                f"the retrieval server for index {index} (corpus {corpus}) exited with status "
                f"{server.returncode} before listening; its log {log_path} ends:\n"
                f"{_tail(log_path)}")
        if time.monotonic() > deadline:
            stop_server(server)
            raise RetrieverStartError(
                f"the retrieval server for index {index} did not listen within "
                f"retrieval.http.start_timeout_s = {retrieval.http.start_timeout_s} s; its log "
                f"{log_path} ends:\n{_tail(log_path)}")
        if time.monotonic() > next_note:
            log.info("still waiting for the retrieval server (loading %s)", index)
            next_note += 30
        time.sleep(0.2)
    url = json.loads(ready.read_text())["url"]
    log.info("retrieval server ready at %s", url)
    return server, url


def stop_server(server: subprocess.Popen) -> None:
    """SIGINT (a graceful shutdown: the server holds on through SIGTERM), SIGKILL if it has not
    exited after STOP_GRACE_S."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    log.info("retrieval server stopped (pid %d, status %s)", server.pid, server.returncode)


def run_with_retriever(retrieval, corpus: str, index: str | None, command: list[str],
                       state_dir: Path) -> int:
    """Steps 1-4 of the module docstring; returns COMMAND's exit status."""
    server, url = start_server(retrieval, corpus, index, state_dir)
    passed = (signal.SIGTERM, signal.SIGUSR1)
    previous = {}
    try:
        job = subprocess.Popen(command, env={**os.environ, ENV_URL: url})
        for sig in passed:
            previous[sig] = signal.signal(sig, lambda s, _f: job.send_signal(s))
        status = job.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_server(server)
    log.info("job finished with status %d", status)
    return status
