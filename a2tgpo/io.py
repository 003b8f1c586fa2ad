"""Atomic file writes: results and checkpoints are never seen half-written.

Everything is written to a temporary sibling and renamed into place (rename is atomic on POSIX
within one filesystem), so a killed job leaves either the old file or the new one. A write the
file system refuses (full, read-only, no permission) fails with `WriteFailed`, naming the path
and what is full or read-only.

Logs that jobs append to line by line (metrics.jsonl, rollouts.jsonl, a sweep's Optuna
journal) cannot be renamed into place; a writer killed mid-line leaves an unfinished last line
(no newline after it). One reader (`iter_jsonl`) skips that line with a warning and treats a
bad line anywhere else as damage; one repair (`cut_unfinished_line`), run by whoever appends
next, cuts it and keeps its bytes in a side file (`<name>.partial`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success rename it over `path`.

    With `directory=True` the temporary path is a fresh directory and replaces any existing
    directory at `path` (the old one is removed only after the new one is complete).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            tmp = Path(name)
    except OSError as e:
        raise explain_write_error(path, e) from e
    # mkstemp/mkdtemp create owner-only entries; results are meant to be shared like any file
    os.chmod(tmp, (0o777 if directory else 0o666) & ~_UMASK)
    try:
        try:
            yield tmp
        except (OSError, RuntimeError) as e:
            # a full or read-only disk surfaces from torch/safetensors as a RuntimeError
            # ("enforce fail at inline_container.cc") that names neither the path nor the cause
            raise explain_write_error(path, e) from e
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


class WriteFailed(OSError):
    """A write failed for a reason of the file system (full, read-only, no permission)."""


def explain_write_error(path: str | Path, error: BaseException) -> BaseException:
    """`error` as a `WriteFailed` naming `path` and what is full or read-only, where the file
    system says so; else `error` itself."""
    path = Path(path)
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    code = getattr(error, "errno", None)
    try:
        st = os.statvfs(where)
    except OSError:
        return error
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if code in (errno.ENOSPC, errno.EDQUOT) or (code is None and free < 1 << 20):
        quota = " or your quota there is used up" if code == errno.EDQUOT else ""
        return WriteFailed(code or errno.ENOSPC, f"cannot write {path}: the file system holding "
                           f"{where} is full{quota} ({_size(free)} free of {_size(total)}); free "
                           f"space there (or point the output elsewhere) and rerun")
    if code == errno.EROFS or (code is None and st.f_flag & os.ST_RDONLY):
        return WriteFailed(errno.EROFS, f"cannot write {path}: the file system holding {where} "
                           "is mounted read-only")
    if code in (errno.EACCES, errno.EPERM):
        return WriteFailed(code, f"cannot write {path}: permission denied in {where}")
    return error


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


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


class JsonLinesError(ValueError):
    """A JSON-lines log holds a bad line that is not its unfinished last one: damage, not a
    killed writer. The message names the file and the 1-based line."""


PARTIAL_SUFFIX = ".partial"  # where cut_unfinished_line keeps the bytes it cut


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, row) for every non-blank line of a JSON-lines log, in file order.

    The last line may be unfinished (no newline after it: a writer killed mid-line, or one
    still writing); when it is not a whole JSON value it is skipped with a warning naming the
    file and line. Any other line that is not a JSON object raises JsonLinesError naming the
    file and line: a reader that skipped it would silently lose what follows.
    """
    path = Path(path)
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError as e:  # JSONDecodeError, or bytes cut inside a UTF-8 character
                if not raw.endswith(b"\n"):
                    log.warning("%s:%d: skipping an unfinished last line (%d bytes; a writer "
                                "killed mid-line, or one still writing)", path, lineno, len(raw))
                    return
                raise JsonLinesError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise JsonLinesError(f"{path}:{lineno}: not a JSON object but a "
                                     f"{type(row).__name__}: {raw[:80]!r}")
            yield lineno, row


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSON-lines file (`iter_jsonl`'s rules)."""
    return [row for _, row in iter_jsonl(path)]


def cut_unfinished_line(path: str | Path) -> int:
    """Make a JSON-lines log end at a line boundary before appending to it; returns the number
    of bytes cut (0: nothing to do, or no file).

    A last line without its newline (a writer killed mid-line) would otherwise be glued to the
    next row, turning both into one bad line in the middle of the file: damage that every later
    read refuses. Its bytes are appended to `<path>.partial` (one cut per line, written and
    synced before the log is cut), so nothing is lost. Call it holding the log's writer lock:
    a writer still at work would lose its line.
    """
    path = Path(path)
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        f.seek(0)
        data = f.read()  # rare (after a crash): the whole file, for the line number
        keep = data.rfind(b"\n") + 1
        side = path.with_name(path.name + PARTIAL_SUFFIX)
        with open(side, "ab") as out:
            out.write(data[keep:] + b"\n")
            out.flush()
            os.fsync(out.fileno())
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    log.warning("%s:%d: cut an unfinished last line (%d bytes: a writer was killed mid-line) "
                "before appending; its bytes are kept in %s", path, data.count(b"\n") + 1,
                size - keep, side)
    return size - keep
