"""The rehearsal: the paper study's code path in miniature, on CPU, before GPU hours are spent.

    a2tgpo rehearse -- snakemake --profile slurm --configfile config/rehearsal.yaml

config/rehearsal.yaml is config/paper.yaml at toy size: the same rules, loaders and jobs
(backbone and encoder pre-fetch from a hub, wiki-18 corpus and prebuilt faiss index through
download-and-verify, FlashRAG data, two tracks, DeepSpeed ranks, vLLM engines, each job's own
retrieval server), with every download served by a local hub (a2tgpo/ops/hub.py) instead of
huggingface.co. `a2tgpo rehearse`:

  1. builds that hub's repos once into `--hub` (default results/rehearsal-hub): a tiny Qwen3
     backbone, the encoder, a wiki-18-format corpus and its prebuilt faiss index, FlashRAG-layout
     data (a2tgpo/rehearsal_hub.py, which builds them with the pipeline's own code);
  2. serves it (`--host`, default 127.0.0.1: jobs on this machine only; on a cluster whose
     compute nodes are other machines, `--host 0.0.0.0` or this host's address on their
     network, and anyone who reaches the port can read the hub; `--port`, default free) and
     runs COMMAND with HF_ENDPOINT pointing at it (`http://<this host's name>:<port>` for a
     wildcard bind, else `http://<host>:<port>`);
  3. stops the hub when COMMAND ends and returns COMMAND's status.
Steps 2 and 3 are `rehearse` here.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
from pathlib import Path

from a2tgpo.ops.hub import LocalHub, summary

log = logging.getLogger(__name__)

BUILT = "hub.json"  # written last by the hub's build (rehearsal_hub.py): the hub folder is complete

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def rehearse(command: list[str], *, hub_dir: str | Path, host: str = "127.0.0.1",
             port: int = 0) -> int:
    """Steps 2-3 of the module docstring, for the hub step 1 built in `hub_dir`; returns
    COMMAND's exit status."""
    built = Path(hub_dir) / BUILT
    if not built.is_file():
        raise FileNotFoundError(f"{built}: no such file: the rehearsal hub in {hub_dir} is not "
                                "built (`a2tgpo rehearse` builds it first)")
    record = json.loads(built.read_text())
    public = socket.getfqdn() if host in ("0.0.0.0", "::") else host
    with LocalHub(hub_dir, host=host, port=port, public_host=public) as hub:
        log.info("%s", summary(hub))
        if host in LOOPBACK:
            reach = (f"bound to {host}: only jobs on this machine reach it (--host 0.0.0.0 "
                     "where compute nodes are other machines)")
        else:
            reach = f"bound to {host}: reachable from other machines, without authentication"
        log.info("rehearsal hub (%s): %d passages; running %s with HF_ENDPOINT=%s", reach,
                 record["passages"], " ".join(command), hub.url)
        env = {**os.environ, "HF_ENDPOINT": hub.url}
        proc = subprocess.Popen(command, env=env)

        def forward(signum, _frame):  # Ctrl-C/TERM reach COMMAND, which stops its own jobs
            proc.send_signal(signum)

        old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            status = proc.wait()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
    log.info("rehearsal command finished with status %d; hub stopped", status)
    return status
