"""Atomic file writes: results and checkpoints are never seen half-written.

Everything is written to a temporary sibling and renamed into place (rename is atomic on POSIX
within one filesystem), so a killed job leaves either the old file or the new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success rename it over `path`.

    With `directory=True` the temporary path is a fresh directory and replaces any existing
    directory at `path` (the old one is removed only after the new one is complete).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
    # mkstemp/mkdtemp create owner-only entries; results are meant to be shared like any file
    os.chmod(tmp, (0o777 if directory else 0o666) & ~_UMASK)
    try:
        yield tmp
        if directory:
            old = None
            if path.exists():
                old = path.with_name(f".{path.name}.old.{os.getpid()}")
                path.rename(old)
            tmp.rename(path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def atomic_write_json(path: str | Path, obj: object) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    """Write one JSON object per line; returns the number of rows."""
    n = 0
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
