"""The GPU benchmarks' code paths, run small on CPU so they cannot rot between GPU sessions."""

import math
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_rl_step_runs_tiny_on_cpu():
    out = subprocess.run([sys.executable, "bench/gpu_rl_step.py", "--tiny"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    table = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1)
                 for line in out.stdout.splitlines() if re.search(r"\S\s{2,}\S", line))
    for key in ("rollout tokens/s (hf engine)", "update tokens/s (A2TGPO loss)"):
        assert float(table[key].replace(",", "")) > 0, out.stdout
    # the IG pass's extra time relative to the old-logprob pass: measured, finite
    assert math.isfinite(float(table["IG extra time / old-logprob time"])), out.stdout
