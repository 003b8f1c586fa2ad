"""Progress that suits a terminal and a log file alike.

On a terminal (stderr is a tty) a loop gets tqdm's live bar. Into a file (a Snakemake job's log,
a SLURM output) every redraw of a bar is kept, carriage returns and all, and `tail -f` shows bar
frames glued to the log lines; so there a loop gets `LineProgress` instead: a plain log line at
most every `LOG_INTERVAL_S` seconds and one at the end, with the count, the postfix values
(loss, reward, ...), the time so far, the rate and the ETA.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger(__name__)

LOG_INTERVAL_S = 5.0


def progress_bar(iterable=None, *, lines: bool = True, **kwargs):
    """`tqdm(iterable, **kwargs)` on a terminal; into a file a `LineProgress` with the same
    arguments (an explicit `mininterval` sets its line interval). `lines=False`: no progress
    lines in a file at all, for a loop that logs its own line per step."""
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(iterable, **kwargs)
    if not lines:
        kwargs["disable"] = True
    return LineProgress(iterable, **kwargs)


class LineProgress:
    """tqdm's interface as far as a2tgpo uses it (iterate or `update`, `set_postfix`, `write`,
    `close`, `n`, a context manager), written as plain INFO lines of this module's logger: one
    when `mininterval` seconds have passed since the last, one at the end. A line reads

        evaluate: 12/20 q (60%), wave=2, live=8 | 8.1 s, 1.48 q/s, ETA 5.4 s
    """

    def __init__(self, iterable=None, *, desc: str = "", total: float | None = None,
                 initial: float = 0, unit: str = "it", unit_scale: bool = False,
                 unit_divisor: int = 1000, disable: bool = False,
                 mininterval: float = LOG_INTERVAL_S):
        if total is None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.desc, self.total, self.n = iterable, desc, total, initial
        self.unit, self.unit_scale, self.unit_divisor = unit, unit_scale, unit_divisor
        self.disable, self.mininterval = disable, mininterval
        self.postfix: dict[str, object] = {}
        self._start_n, self._logged_n = initial, initial
        self._t0 = self._last = time.monotonic()
        self._closed = False

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def update(self, n: float = 1) -> None:
        self.n += n
        now = time.monotonic()
        if not self.disable and now - self._last >= self.mininterval:
            self._line(now)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        # the next line shows them: a line per change would be one per step again
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def write(self, s: str) -> None:
        log.info("%s", s)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.disable and self.n != self._logged_n:
            self._line(time.monotonic(), final=True)

    def _line(self, now: float, final: bool = False) -> None:
        self._last, self._logged_n = now, self.n
        elapsed = now - self._t0
        sep = "" if self.unit_scale else " "  # 1.21M/3.50MB, 12/20 q
        count = self._amount(self.n)
        if self.total:
            count += (f"/{self._amount(self.total)}{sep}{self.unit} "
                      f"({100 * self.n / self.total:.0f}%)")
        else:
            count += f"{sep}{self.unit}"
        post = "".join(f", {k}={v}" for k, v in self.postfix.items())
        done = self.n - self._start_n
        pace = [f"{'done in ' if final else ''}{duration(elapsed)}"]
        if done > 0 and elapsed > 0:
            rate = done / elapsed
            pace.append(f"{self._amount(rate)}{sep}{self.unit}/s" if self.unit_scale
                        else f"{rate:.3g} {self.unit}/s")
        left = eta_s(elapsed, done, None if self.total is None else self.total - self._start_n)
        if left is not None and not final:
            pace.append(f"ETA {duration(left)}")
        log.info("%s: %s%s | %s", self.desc or "progress", count, post, ", ".join(pace))

    def _amount(self, x: float) -> str:
        if self.unit_scale:
            from tqdm import tqdm

            return tqdm.format_sizeof(x, divisor=self.unit_divisor)
        return f"{x:g}" if isinstance(x, float) else str(x)


def eta_s(elapsed: float, done: float, total: float | None) -> float | None:
    """Seconds left for `total` units at the pace of `done` units in `elapsed` seconds; None
    before the first unit or without a total."""
    if total is None or done <= 0:
        return None
    return max(0.0, elapsed / done * (total - done))


def duration(seconds: float) -> str:
    """41.2 s, 3m07s, 2h05m: short enough for a progress line."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
