"""Progress bars into a log file redraw every few seconds, not at every update."""

import io
import sys

from a2tgpo.progress import LOG_INTERVAL_S, progress_bar


def test_a_bar_into_a_file_is_throttled(monkeypatch):
    log = io.StringIO()  # not a terminal, as a job's log file
    monkeypatch.setattr(sys, "stderr", log)
    bar = progress_bar(range(1000), file=log, desc="x")
    assert bar.mininterval == LOG_INTERVAL_S == 5.0
    for _ in bar:
        pass
    # a 1000-step loop that takes well under 5 s: the opening draw and the closing one only
    assert log.getvalue().count("\r") <= 3
    assert progress_bar(range(3), file=log, mininterval=0.5).mininterval == 0.5  # asked: kept


def test_a_bar_on_a_terminal_keeps_tqdms_own_interval(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    assert progress_bar(range(3), file=io.StringIO()).mininterval == 0.1  # tqdm's default
