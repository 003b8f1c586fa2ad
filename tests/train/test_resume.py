"""A training job killed with SIGKILL and rerun ends exactly where an uninterrupted job ends;
while it runs, a second job on its run folder is refused.

Both runs are real `a2tgpo train` processes on the toy world (GRPO from the warm-started
model). The interrupted one is killed right after its second checkpoint, and its newest
checkpoint is then damaged on disk (one byte of the weights, same size); the rerun detects it,
moves it aside and resumes from the complete checkpoint before it (weights, optimizer,
scheduler, RNG states, data order), and must reproduce the uninterrupted run bit for bit on
CPU: the same final weights and the same logged metrics for every step (timings excepted).
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from run_records import learned_summary

from a2tgpo.algo.methods import METHODS
from a2tgpo.config import dump_config
from a2tgpo.ops.lock import holder
from a2tgpo.tracking import read_metrics
from a2tgpo.train.checkpoint import checkpoint_step, latest_checkpoint
from a2tgpo.train.config import ScheduleConfig
from a2tgpo.train.rl import ROLLOUT_TIMES

pytestmark = pytest.mark.slow

STEPS = 6
KILL_AFTER = 2  # steps saved before the kill (a checkpoint every step)

# the rollout's wall-clock numbers (rl.ROLLOUT_TIMES), like time/*
ROLLOUT_WALL_CLOCK = tuple(f"rollout/{k}" for k in ROLLOUT_TIMES)


def _command(cfg_path):
    return [sys.executable, "-c", ("import sys; from a2tgpo.cli import main; "
                                   "sys.exit(main(sys.argv[1:]))"), "train", str(cfg_path)]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _final_weights(run_dir):
    from safetensors.torch import load_file

    ckpt = latest_checkpoint(run_dir)
    return ckpt.name, load_file(ckpt / "model" / "model.safetensors")


def _step_rows(run_dir):
    """The last row logged for each step, without wall-clock values."""
    rows = {}
    for row in read_metrics(run_dir):
        rows[row["step"]] = {k: v for k, v in row.items()
                             if k != "time" and not k.startswith(("time/", "throughput/",
                                                                  "val/seconds",
                                           *ROLLOUT_WALL_CLOCK))}
    return rows


@pytest.mark.expensive  # ~50 s on 2 cores: CI runs it in its expensive step (.ci/run)
def test_sigkill_then_rerun_matches_uninterrupted(toy_train_config, tmp_path):
    method = dataclasses.replace(METHODS["grpo"], rollout=dataclasses.replace(
        METHODS["grpo"].rollout, n=4))
    schedule = ScheduleConfig(steps=STEPS, prompts_per_step=2, mini_batch_prompts=1,
                              micro_batch_size=4, eval_every=3, eval_questions=4,
                              save_every=1, keep_last=2)
    runs = {}
    for name in ("straight", "killed"):
        cfg = toy_train_config(tmp_path / name, method, schedule=schedule, lr=3e-3)
        dump_config(cfg, tmp_path / f"{name}.yaml")
        runs[name] = tmp_path / name

    done = subprocess.run(_command(tmp_path / "straight.yaml"), env=_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    proc = subprocess.Popen(_command(tmp_path / "killed.yaml"), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # one writer per run folder: a second job on it, once the first holds it, fails at once
    # naming the first (it has not saved a checkpoint yet: the kill below is not delayed)
    while holder(runs["killed"]) is None or holder(runs["killed"])["pid"] != proc.pid:
        assert proc.poll() is None, "the job ended before it held its run folder"
        time.sleep(0.02)
    second = subprocess.run(_command(tmp_path / "killed.yaml"), env=_env(), capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 1, second.stderr[-3000:]
    assert f"run folder {runs['killed']} is in use by pid {proc.pid}" in second.stderr
    assert proc.poll() is None  # and the first goes on
    marker = runs["killed"] / "checkpoints" / f"step_{KILL_AFTER:06d}" / "COMPLETE"
    deadline = time.time() + 600
    while not marker.exists():
        assert proc.poll() is None, "the job ended before it could be killed"
        assert time.time() < deadline, "no checkpoint after 10 minutes"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (runs["killed"] / "summary.json").exists()  # it really stopped mid-training
    latest = latest_checkpoint(runs["killed"])
    assert latest.name in (f"step_{KILL_AFTER:06d}", f"step_{KILL_AFTER + 1:06d}")
    # the newest checkpoint damaged in place: its size unchanged, one byte of the weights off
    weights = latest / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-len(data) // 3] ^= 0xFF
    weights.write_bytes(bytes(data))
    before = checkpoint_step(latest) - 1

    rerun = subprocess.run(_command(tmp_path / "killed.yaml"), env=_env(), capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    # the killed job's lock was released by its end: taken over
    assert f"took over the lock last held by pid {proc.pid}" in rerun.stderr
    assert f"{latest} is damaged: model/model.safetensors has sha256" in rerun.stderr
    assert f"resumed from {latest.with_name(f'step_{before:06d}')} (step {before})" \
        in rerun.stderr
    assert (latest.with_name(f"damaged_{latest.name}") / "COMPLETE").is_file()

    name_a, weights_a = _final_weights(runs["straight"])
    name_b, weights_b = _final_weights(runs["killed"])
    assert name_a == name_b == f"step_{STEPS:06d}"
    assert weights_a.keys() == weights_b.keys()
    differ = [k for k in weights_a if not torch.equal(weights_a[k], weights_b[k])]
    assert not differ, f"weights differ after the resume: {differ}"
    # and training moved them: the comparison is not between two untouched models
    start = _start_weights(toy_train_config, tmp_path)
    assert any(not torch.equal(start[k], weights_a[k]) for k in start)

    rows_a, rows_b = _step_rows(runs["straight"]), _step_rows(runs["killed"])
    assert sorted(rows_a) == sorted(rows_b) == list(range(STEPS + 1))
    # what the killed job logged after the checkpoint the rerun resumed from was cut, not
    # logged a second time (its newest checkpoint, at least, came after its row)
    assert [r["step"] for r in read_metrics(runs["killed"])] == list(range(STEPS + 1))
    assert read_metrics(runs["killed"], "rollouts.jsonl") == \
        read_metrics(runs["straight"], "rollouts.jsonl")
    for step in rows_a:
        assert rows_a[step] == rows_b[step], f"step {step} metrics differ"
    assert learned_summary(runs["straight"]) == learned_summary(runs["killed"])


def _start_weights(toy_train_config, tmp_path):
    from safetensors.torch import load_file

    cfg = toy_train_config(tmp_path / "x", METHODS["grpo"],
                           schedule=ScheduleConfig(steps=1, prompts_per_step=1,
                                                   mini_batch_prompts=1))
    return load_file(os.path.join(cfg.backbone.path, "model.safetensors"))
