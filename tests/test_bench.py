"""The benchmarks' code paths, run small on CPU so that they cannot rot (the GPU ones between
GPU sessions)."""

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


def test_toy_update_runs_quick():
    out = subprocess.run([sys.executable, "bench/toy_update.py", "--quick"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {m[1]: [float(x) for x in m.groups()[1:]] for m in (
        re.match(r"(before|rows|budget \d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s", line)
        for line in out.stdout.splitlines()) if m}
    assert {"before", "rows", "budget 1024", "budget 2048", "budget 4096"} <= set(rows), out.stdout
    for computed_real, seconds, vs_before in rows.values():
        # rows x columns of the update's forwards cover at least every real token
        assert math.isfinite(computed_real) and computed_real >= 1, out.stdout
        assert math.isfinite(seconds) and seconds > 0 and vs_before > 0, out.stdout
    assert rows["before"][2] == 1.0 and "summary: computed/real" in out.stdout, out.stdout


def test_plan_memory_runs_quick():
    out = subprocess.run([sys.executable, "bench/plan_memory.py", "--quick"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("qwen3-")]
    assert [r[1] for r in rows] == ["update", "ig"], out.stdout
    for r in rows:
        planned, measured, ratio = map(float, r[-3:])
        # the pass allocated something and the plan predicted something
        assert planned > 0 and measured > 0 and math.isfinite(ratio), out.stdout
    assert "largest deviation of planned from measured" in out.stdout


def test_retrieval_load_runs_quick():
    out = subprocess.run([sys.executable, "bench/retrieval_load.py", "--quick"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    table = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1)
                 for line in out.stdout.splitlines() if re.search(r"\S\s{2,}\S", line))
    # --quick: 3 phases of 40 small requests, and 1 large in each of the 2 mixed phases
    assert table["innocent requests"] == "122" and table["innocent failures"] == "0", out.stdout
    assert table["bad requests with an unexpected status"] == "0", out.stdout
    # 4 bad requests per mixed phase, one of each kind, each answered with its status
    assert re.search(r"bad requests  8: lone surrogate -> 422 x2, retriever fails -> 500 x2, "
                     r"too many queries -> 413 x2, topk 10\*\*9 -> 422 x2", out.stdout), out.stdout
    ratio = float(table["small p99 with large ones present: unsplit / split"])
    assert math.isfinite(ratio) and ratio > 0, out.stdout
