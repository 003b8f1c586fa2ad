"""Progress into a log file is plain lines (count, values, time, rate, ETA) at most every few
seconds; on a terminal it is tqdm's live bar."""

import fcntl
import io
import logging
import os
import pty
import struct
import subprocess
import sys
import termios

import pytest

from a2tgpo import progress
from a2tgpo.progress import LOG_INTERVAL_S, LineProgress, duration, eta_s, progress_bar

# a job's loop as the CLI runs it: logging set up by the same function, then a progress loop
LOOP = """
from a2tgpo.ops.joblog import setup_logging
from a2tgpo.progress import progress_bar
setup_logging()
bar = progress_bar(range(4), desc="demo", unit="step", mininterval=0)
for i in bar:
    bar.set_postfix(loss=f"{0.5 / (i + 1):.3f}")
"""


def test_a_loop_into_a_file_writes_one_plain_line_per_update(tmp_path):
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", LOOP], stderr=f, check=True, timeout=60)
    text = log.read_bytes().decode()  # read_text() would turn each \r into \n
    assert "\r" not in text and "|█" not in text  # no redraws, no bar frames
    lines = [ln.split("a2tgpo.progress: ", 1)[1] for ln in text.splitlines()
             if "a2tgpo.progress: " in ln]
    # mininterval 0: a line after each of the 4 steps (25% each), with the postfix the step
    # set before it (loss 0.5 / (i + 1)); none at the end, which the 4th line already showed
    assert [ln.split(" | ")[0] for ln in lines] == [
        "demo: 1/4 step (25%), loss=0.500", "demo: 2/4 step (50%), loss=0.250",
        "demo: 3/4 step (75%), loss=0.167", "demo: 4/4 step (100%), loss=0.125"]
    assert all(" step/s, ETA " in ln for ln in lines)


def test_a_loop_on_a_terminal_draws_a_live_bar():
    master, slave = pty.openpty()
    # 24 x 80 as a terminal window (a fresh pty is 0 columns wide: tqdm would draw nothing)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    p = subprocess.Popen([sys.executable, "-c", LOOP], stderr=slave, stdout=subprocess.DEVNULL)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(timeout=60) == 0
    text = out.decode()
    assert "\r" in text and "demo: 100%|" in text and "4/4" in text  # tqdm redrawing in place
    assert "a2tgpo.progress" not in text  # no log lines besides the bar


def test_lines_come_every_interval_with_rate_and_eta(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.INFO, logger="a2tgpo.progress")
    bar = LineProgress(total=12, desc="x", unit="step")
    assert bar.mininterval == LOG_INTERVAL_S == 5.0
    for t in range(1, 13):  # one step a second
        now[0] = float(t)
        bar.update(1)
    bar.close()
    # lines at t = 5 and 10 (5 s after the last), and the closing one at 12; at 1 step/s,
    # 7 and 2 steps are left
    assert [r.getMessage() for r in caplog.records] == [
        "x: 5/12 step (42%) | 5.0 s, 1 step/s, ETA 7.0 s",
        "x: 10/12 step (83%) | 10.0 s, 1 step/s, ETA 2.0 s",
        "x: 12/12 step (100%) | done in 12.0 s, 1 step/s"]


def test_a_resumed_loop_paces_only_its_own_steps(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.INFO, logger="a2tgpo.progress")
    bar = LineProgress(range(100, 240), initial=100, total=240, desc="grpo seed 1", unit="step")
    now[0] = 50.0
    bar.update(10)
    # 10 steps in 50 s (0.2 step/s; the 100 of an earlier job do not count), 130 left:
    # 130 * 5 s = 650 s
    assert caplog.records[-1].getMessage() == (
        "grpo seed 1: 110/240 step (46%) | 50.0 s, 0.2 step/s, ETA 10m50s")


def test_byte_counts_are_scaled(monkeypatch, caplog):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    caplog.set_level(logging.INFO, logger="a2tgpo.progress")
    with LineProgress(total=4 * 2**20, desc="verify c.jsonl", unit="B", unit_scale=True,
                      unit_divisor=1024) as bar:
        now[0] = 5.0
        bar.update(2**20)
    # 1 MiB of 4 in 5 s: 204.8 KiB/s, 15 s left
    assert caplog.records[0].getMessage() == (
        "verify c.jsonl: 1.00M/4.00MB (25%) | 5.0 s, 205kB/s, ETA 15.0 s")


def test_no_lines_where_the_caller_logs_its_own(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="a2tgpo.progress")
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    bar = progress_bar(range(3), desc="grpo", lines=False, mininterval=0)
    assert isinstance(bar, LineProgress)
    assert list(bar) == [0, 1, 2] and bar.n == 3
    assert not caplog.records


@pytest.mark.parametrize("seconds, text", [(41.23, "41.2 s"), (187, "3m07s"), (7500, "2h05m")])
def test_durations_read_short(seconds, text):
    assert duration(seconds) == text


def test_eta_needs_a_finished_unit_and_a_total():
    assert eta_s(10.0, 0, 100) is None and eta_s(10.0, 5, None) is None
    assert eta_s(10.0, 5, 20) == 30.0  # 2 s a unit, 15 left
