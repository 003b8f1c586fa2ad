"""Progress bars that suit a terminal and a log file alike.

On a terminal a bar redraws as often as tqdm likes. Into a file (a Snakemake job's log, a
SLURM output) every redraw is kept, so a bar there redraws at most every `LOG_INTERVAL_S`
seconds: the log shows progress without one entry per step (an SFT log held 1,620 redraws).
"""

from __future__ import annotations

import sys

LOG_INTERVAL_S = 5.0


def progress_bar(iterable=None, **kwargs):
    """`tqdm(iterable, **kwargs)`, throttled to one redraw every LOG_INTERVAL_S seconds when
    stderr is not a terminal (an explicit `mininterval` wins)."""
    from tqdm import tqdm

    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    return tqdm(iterable, **kwargs)
