"""One writer per folder: an exclusive lock a job holds on its run folder while it writes there.

    with folder_lock(run_dir, "run folder"):
        train(...)

The lock is `flock(2)` on a sibling file `<parent>/.<name>.lock` (beside the folder, not in it,
so the folder can be moved aside or replaced under the lock). The kernel drops the lock when
the holding process ends, however it ends (SIGKILL, a crash, a lost node on NFS once the server
notices), so a lock left by a dead process is taken over at once and safely: taking it is one
atomic `flock` call, never "look whether the holder is alive, then write". The file also
records the holder (pid, host, command, since), which is only read to tell a second writer who
holds the folder.

Nested `folder_lock` calls for the same folder in one process are counted, not re-locked (a
sweep trial locks its run folder, then training locks it again). File systems without locks
(Lustre mounted without `flock`) get a warning and no lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_held: dict[Path, list] = {}  # lock file -> [open file, nesting count], this process's locks


class FolderBusy(RuntimeError):
    """Another process holds the folder's lock."""


def lock_file(folder: str | Path) -> Path:
    folder = Path(folder).absolute()
    return folder.parent / f".{folder.name}.lock"


def holder(folder: str | Path) -> dict | None:
    """What the lock file says of its last holder (None: no record). Whether that holder still
    holds it only `flock` can tell."""
    try:
        return json.loads(lock_file(folder).read_text() or "null")
    except (OSError, ValueError):
        return None


def _describe(h: dict | None) -> str:
    if not h:
        return "another process (it left no record)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h.get("since", 0)))
    command = f" ({h['command']})" if h.get("command") else ""
    return f"pid {h.get('pid')} on host {h.get('host')} since {since}{command}"


def in_use(folder: str | Path) -> str | None:
    """Who holds `folder`'s lock, described, or None when no other process does. For a look
    that must change nothing (a dry run): it creates no file and records nothing, and holds a
    shared lock only for the instant of the test."""
    path = lock_file(folder)
    if path in _held:
        return None
    try:
        f = open(path)
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _describe(holder(folder))
        except OSError:  # no locks on this file system: nothing can be known
            return None
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str = "folder") -> Iterator[None]:
    """Hold the exclusive lock of `folder` while the block runs; raise `FolderBusy` at once
    (no waiting) if another process holds it."""
    path = lock_file(folder)
    if path in _held:
        _held[path][1] += 1
        try:
            yield
        finally:
            _held[path][1] -= 1
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderBusy(
                f"{what} {Path(folder)} is in use by {_describe(holder(folder))}: two jobs "
                f"must not write one folder. Wait for that job to end (a job whose Snakemake "
                f"was killed stops by itself at its next safe point) or end it, then rerun; "
                f"the lock is {path}") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            log.warning("%s: the file system does not support locks (%s): no writer lock on "
                        "%s %s", path, e.strerror, what, folder)
            f.close()
            yield
            return
        previous = holder(folder)
        if previous and previous.get("pid") != os.getpid():
            log.info("%s %s: took over the lock last held by %s, which has ended", what,
                     folder, _describe(previous))
        f.seek(0)
        f.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                   "command": " ".join(sys.argv[:3])}, f)
        f.flush()
        _held[path] = [f, 1]
        try:
            yield
        finally:
            del _held[path]
    finally:
        f.close()  # releases the lock
