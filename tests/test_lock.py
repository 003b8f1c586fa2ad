"""One writer per folder (a2tgpo/ops/lock.py) and jobs that end with their Snakemake (the anchor,
a2tgpo/ops/preemption.py). The other side of each lock is a real second process."""

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from a2tgpo.ops.lock import FolderBusy, folder_lock, in_use, lock_file
from a2tgpo.ops.preemption import ANCHOR_ENV, anchor_alive, anchor_value, watch_anchor

# holds the lock of argv[1], says so on stdout, then waits to be killed
HOLDER = """
import sys, time
from a2tgpo.ops.lock import folder_lock
with folder_lock(sys.argv[1], "run folder"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """start(folder) -> a process holding the lock of `folder`; killed at the end."""
    procs = []

    def start(folder):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE,
                             text=True)
        procs.append(p)
        assert p.stdout.readline().strip() == "held"
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path, holder):
    run = tmp_path / "runs" / "cell"
    p = holder(run)
    t0 = time.monotonic()
    with pytest.raises(FolderBusy) as e, folder_lock(run, "run folder"):
        pass
    waited = time.monotonic() - t0
    msg = str(e.value)
    assert f"run folder {run} is in use by pid {p.pid} on host {socket.gethostname()}" in msg
    assert str(lock_file(run)) in msg
    print(f"refused after {waited * 1e3:.1f} ms")


def test_a_lock_left_by_a_killed_process_is_taken_over(tmp_path, holder, caplog):
    run = tmp_path / "cell"
    p = holder(run)
    p.send_signal(signal.SIGKILL)
    p.wait()
    with caplog.at_level(logging.INFO, "a2tgpo.ops.lock"), folder_lock(run, "run folder"):
        pass
    assert f"took over the lock last held by pid {p.pid}" in caplog.text


def test_the_lock_is_beside_the_folder_so_moving_the_folder_keeps_it(tmp_path, holder):
    # a sweep trial moves an old run folder aside under the lock, then trains a new one there
    run = tmp_path / "trials" / "0" / "run"
    run.mkdir(parents=True)
    holder(run)
    run.rename(run.with_name("run.aside-1"))
    with pytest.raises(FolderBusy), folder_lock(run):
        pass


def test_nested_holds_in_one_process_and_release_at_the_end(tmp_path):
    run = tmp_path / "cell"
    with folder_lock(run), folder_lock(run):  # a sweep trial, then its training
        pass
    # released: another process takes it
    out = subprocess.run([sys.executable, "-c", HOLDER.replace("time.sleep(600)", "pass"),
                          str(run)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "held", out.stderr


def test_in_use_names_the_holder_and_changes_nothing(tmp_path, holder):
    # a dry run's look: no lock file is created where none was, none is taken or rewritten
    run = tmp_path / "runs" / "cell"
    assert in_use(run) is None
    assert not lock_file(run).parent.exists()
    p = holder(run)
    record = lock_file(run).read_text()
    assert in_use(run).startswith(f"pid {p.pid} on host {socket.gethostname()} since ")
    assert lock_file(run).read_text() == record
    p.kill()
    p.wait()
    assert in_use(run) is None  # the kernel dropped the dead holder's lock
    with folder_lock(run):  # this process's own lock is no other process's
        assert in_use(run) is None


# --------------------------------------------------------------------------------------------
# the anchor

# waits for SIGTERM (what watch_anchor sends once the anchor has ended), then says so
WATCHER = """
import signal, sys, time
from a2tgpo.ops.preemption import watch_anchor
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
assert watch_anchor(poll_s=0.05) is not None
print("watching", flush=True)
deadline = time.monotonic() + 60
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
print("SIGTERM" if got else "no signal", flush=True)
"""


def test_a_job_gets_sigterm_when_its_anchor_ends(tmp_path):
    anchor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        job = subprocess.Popen([sys.executable, "-c", WATCHER], stdout=subprocess.PIPE,
                               text=True, env={**os.environ, ANCHOR_ENV: anchor_value(anchor.pid)})
        assert job.stdout.readline().strip() == "watching"
        anchor.kill()
        anchor.wait()  # reaped: gone from /proc
        out, _ = job.communicate(timeout=60)
        assert out.strip() == "SIGTERM"
    finally:
        anchor.kill()


def test_anchor_identity_and_visibility():
    me = anchor_value()
    assert anchor_alive(me) is True
    host, pid, start = me.rsplit(":", 2)
    # the same pid with another start time is another (reused) process: ended
    assert anchor_alive(f"{host}:{pid}:{int(start) + 1}") is False
    # another host's process cannot be seen from here: no watch, rather than a false alarm
    assert anchor_alive(f"not-{host}:{pid}:{start}") is None
    assert watch_anchor(environ={ANCHOR_ENV: f"not-{host}:{pid}:{start}"}) is None
    assert watch_anchor(environ={}) is None
