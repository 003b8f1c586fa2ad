"""Helpers for tests that compare two training runs' records (a module of its own: each test
folder's conftest.py is imported as `conftest`, so a helper there is not found from every test)."""

import json
from pathlib import Path


def learned_summary(run_dir) -> dict:
    """A run's summary.json without the job's peak memory: a measurement, like the timings, so
    two runs that learned the same thing may differ there."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return {k: v for k, v in summary.items() if not k.startswith("peak_memory/")}
