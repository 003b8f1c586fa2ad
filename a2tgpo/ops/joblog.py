"""A job's log as a person reads it (`tail -f train.log` on a cluster).

`setup_logging`, which every `a2tgpo` command runs first (cli.main), formats the log lines and
keeps other libraries' noise out of the job logs:

  - faiss's loader logs at INFO each instruction set it tries and each fallback ("Could not
    load library with AVX512 support due to: ModuleNotFoundError(No module named
    'faiss.swigfaiss_avx512')"), six lines per job on a CPU without AVX-512; only its warnings
    are kept;
  - DeepSpeed warns "Setting accelerator to CPU" in every job without a GPU (the header below
    names the devices);
  - into a file, Hugging Face's progress bars (transformers' "Loading weights" and "Writing model
    shards", hub downloads, datasets) and MLflow's artifact bar are off: each redraw would be
    kept with its carriage return. Our own loops write plain lines there (a2tgpo/progress.py).

`begin` and `end` frame the job: its log begins with what it is (command, cell, command line,
config hash, host, devices) and ends with how it went (time, exit status, what the command
reports, such as steps and the best step, and where its outputs are).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import socket
import sys
from pathlib import Path

log = logging.getLogger("a2tgpo.job")

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# the log file (device:inode) an outer a2tgpo process has begun already: `with-retriever` and
# `launch` run the job's own a2tgpo command into the same file, which needs no second header
ENV_BEGUN = "A2TGPO_JOB_LOG"
NVIDIA_PROC = "/proc/driver/nvidia/gpus"


class _DropMessages(logging.Filter):
    def __init__(self, *starts: str):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


# DeepSpeed's logger (named "DeepSpeed") writes to stdout through a handler of its own, so the
# filter sits on the logger itself; one instance, so a second setup adds nothing
_DEEPSPEED_CPU = _DropMessages("Setting accelerator to CPU")


def setup_logging(verbose: bool = False, stream=None) -> None:
    """Log lines with time, level and logger on stderr; third-party noise off (module doc)."""
    stream = sys.stderr if stream is None else stream
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=FORMAT)
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)
    logging.getLogger("DeepSpeed").addFilter(_DEEPSPEED_CPU)
    if not stream.isatty():
        quiet_progress_bars()


def quiet_progress_bars() -> None:
    """Turn Hugging Face's and MLflow's progress bars off, for this process and the ones it
    starts; a variable set by hand wins. The libraries read these variables at import, so one
    imported already is told directly."""
    for var, value in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("HF_DATASETS_DISABLE_PROGRESS_BARS", "1"),
                       ("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")):
        os.environ.setdefault(var, value)
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


# --------------------------------------------------------------------------------------------
# the header and the summary


def header_due(stream=None, environ: dict[str, str] | None = None, *, mark: bool = False
               ) -> bool:
    """Whether this process writes its log's header: not on a terminal (whoever reads it just
    typed the command), not on a launched rank other than 0, not into a file an outer a2tgpo
    process began (ENV_BEGUN). `mark`: a command that runs another a2tgpo command into its own
    log (with-retriever, launch) marks the file in `environ` for it."""
    stream = sys.stderr if stream is None else stream
    env = os.environ if environ is None else environ
    if stream.isatty() or env.get("RANK", "0") != "0":
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # a stream without a file (tests' capture)
        return True
    key = f"{st.st_dev}:{st.st_ino}"
    if env.get(ENV_BEGUN) == key:
        return False
    if mark:
        env[ENV_BEGUN] = key
    return True


def begin(command: str, argv: list[str], config: str | Path | None = None) -> list[str]:
    """Log the header; returns its lines. `config`: the job's config file, whose top-level
    `cell` (a grid cell's resolved config has one) names the job."""
    cell, digest = None, None
    if config is not None and Path(config).is_file():
        raw = Path(config).read_bytes()
        digest = hashlib.sha256(raw).hexdigest()[:12]
        cell = _top_level_cell(raw)
    first = f"a2tgpo {command}" + (f" · cell {cell}" if cell else "")
    where = [f"host {socket.gethostname()}", f"pid {os.getpid()}"]
    if os.environ.get("SLURM_JOB_ID"):
        where.append(f"SLURM job {os.environ['SLURM_JOB_ID']}")
    lines = [first, "command: " + shlex.join(argv),
             (f"config {config} (sha256 {digest}) · " if digest else "") + ", ".join(where),
             "devices: " + devices()]
    for line in lines:
        log.info("%s", line)
    return lines


def end(command: str, rc: int | None, seconds: float, summary: str | None = None,
        out: str | Path | None = None) -> str:
    """Log the closing line: time, exit status, the command's summary, its outputs."""
    from a2tgpo.ops.preemption import EXIT_PREEMPTED
    from a2tgpo.progress import duration

    status = {0: "finished", EXIT_PREEMPTED: f"stopped, resumable (exit {rc})"}.get(
        rc, f"failed (exit {rc})")
    line = f"a2tgpo {command} {status} in {duration(seconds)}"
    if summary:
        line += f": {summary}"
    if out is not None:
        line += f"; outputs in {out}"
    (log.info if rc == 0 else log.warning)("%s", line)
    return line


def _top_level_cell(raw: bytes) -> str | None:
    """The `cell: ...` line at the top level of a YAML file, without parsing the whole file (a
    study config is long, a cell's config names its cell on one line)."""
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("cell:"):
            value = line[len("cell:"):].strip().strip("'\"")
            return value or None
    return None


def devices(environ: dict[str, str] | None = None, proc: str | Path = NVIDIA_PROC) -> str:
    """The GPUs and CPUs this job may use, read without importing torch (which would add
    seconds to every job): the NVIDIA driver lists the node's GPUs under /proc,
    CUDA_VISIBLE_DEVICES narrows them (by index in PCI order, or by UUID)."""
    from a2tgpo.ops.job_cpus import granted_cpus

    env = os.environ if environ is None else environ
    gpus = []  # (uuid, model) in PCI bus order
    for info in sorted(Path(proc).glob("*/information")):
        fields = dict(line.split(":", 1) for line in info.read_text().splitlines()
                      if ":" in line)
        gpus.append((fields.get("GPU UUID", "").strip(), fields.get("Model", "GPU").strip()))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    note = ""
    if visible is not None:
        note = f" (CUDA_VISIBLE_DEVICES={visible})"
        chosen = []
        for v in (v.strip() for v in visible.split(",")):
            # CUDA stops at the first entry it cannot match; a UUID may be given by a prefix
            match = (gpus[int(v): int(v) + 1] if v.isdigit()
                     else [g for g in gpus if v and g[0].startswith(v)])
            if not match:
                break
            chosen.append(match[0])
        gpus = chosen
    counts: dict[str, int] = {}
    for _, model in gpus:
        counts[model] = counts.get(model, 0) + 1
    n_cpus, _ = granted_cpus(env)
    gpu_text = ", ".join(f"{n} × {m}" for m, n in counts.items()) or "no GPU"
    return f"{gpu_text}{note}; {n_cpus} CPUs"
