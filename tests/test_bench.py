"""The benchmarks' code paths, run small on CPU so that they cannot rot (the GPU ones between
GPU sessions)."""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.expensive  # ~35 s of the default suite's time: CI runs it in its own step
def test_gpu_check_runs_tiny_on_cpu():
    """bench/gpu_check.sh --tiny: the GPU check's steps (the colocation probe, one RL step, the
    throughput bench) on CPU with tiny models, each finishing, in the project environment."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                 f"{os.environ.get('PATH', '')}", "PYTHON": sys.executable}
    out = subprocess.run(["bash", "bench/gpu_check.sh", "--tiny"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    ran = re.findall(r"^== (.+): exit (\d+) after", text, re.M)
    assert ran == [("colocation probe", "0"), ("one RL step (Qwen3-0.6B)", "0"),
                   ("Qwen3-4B throughput", "0")], text[-4000:]
    # the probe's update: log pi_old from the update's own path, so the first update is
    # on-policy (nothing clips, every ratio 1)
    assert re.search(r"update: first update: pg_clipfrac 0\.0000, ratio_mean 1\.000000", text), \
        text[-4000:]
    # its every section ran: no failure, out-of-memory or missing measurement
    assert "FAILED" not in text and "OUT OF MEMORY" not in text, text[-4000:]
    for section in ("logprob", "update", "wake", "save", "plan"):
        assert re.search(rf"\] {section}: ", text), section
    # the RL step's rows: measured and finite
    table = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1)
                 for line in out.stdout.splitlines() if re.search(r"^\S.*\S\s{2,}\S", line))
    for key in ("rollout tokens/s (hf engine)", "update tokens/s (A2TGPO loss)"):
        assert float(table[key].replace(",", "")) > 0, out.stdout
    assert math.isfinite(float(table["IG extra time / old-logprob time"])), out.stdout


@pytest.mark.expensive  # ~20 s: CI runs it in its own step
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


@pytest.mark.expensive  # ~20 s: CI runs it in its own step
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


def test_step_time_runs_quick():
    """bench/step_time.py --quick (~2 s): the table's stages for both schedules, the
    per-trajectory rollout as a ratio to waves, and the Fig. 7 calibration lines."""
    out = subprocess.run([sys.executable, "bench/step_time.py", "--quick"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("H20 ")]
    assert [(r[2], r[3]) for r in rows] == [("grpo", "waves"), ("grpo", "trajectory"),
                                            ("a2tgpo", "waves"), ("a2tgpo", "trajectory")]
    for r in rows:
        stages = [float(x) for x in r[4:10]]  # rollout ... other
        assert all(math.isfinite(x) and x >= 0 for x in stages) and stages[0] > 0, r
        assert float(r[10]) == pytest.approx(sum(stages), abs=1), r  # total
        assert 0 < float(r[11]) <= 1, r  # the engine's busy share
    # the trajectory rows carry their rollout's ratio to the waves row above them
    for waves, traj in zip(rows[::2], rows[1::2], strict=True):
        assert float(traj[-1]) == pytest.approx(float(traj[4]) / float(waves[4]), abs=0.01)
    cal = re.findall(r"^  (grpo|a2tgpo)\s+(total|rollout|ig)\s+model\s+(\d+) s\s+paper\s+(\d+) s"
                     r"\s+error ([+-]\d+)%", out.stdout, re.M)
    assert [(m, k, p) for m, k, _, p, _ in cal] == [
        ("grpo", "total", "511"), ("grpo", "rollout", "262"), ("a2tgpo", "total", "525"),
        ("a2tgpo", "rollout", "176"), ("a2tgpo", "ig", "164")], out.stdout
    for _, _, model, paper, err in cal:  # model and paper printed rounded: within 1 point
        assert abs(int(err) - (int(model) / int(paper) - 1) * 100) <= 1, out.stdout
    assert re.search(r"^calibration error: largest \d+%, mean \d+% \(goal <= 25%\)$",
                     out.stdout, re.M), out.stdout
