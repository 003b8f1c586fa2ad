"""Stopping for a time limit or a preemption: at a safe point, with a checkpoint, resumable.

A real SIGTERM is sent to this process at chosen moments of a toy GRPO run (`train` in
process, so the moment can be chosen): during the rollouts of step 3, during the validation of
step 4, or never with a time budget that ends after the first step. Each run must exit 75
with the checkpoint the stop calls for, and a rerun must end exactly where an uninterrupted
run ends: the same final weights and the same logged metrics for every step (timings
excepted). The SLURM path (the signal from a real time limit) is tests/workflow/test_slurm.py.
"""

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.ops.preemption import (
    ANCHOR_ENV,
    EXIT_PREEMPTED,
    PreemptionHandler,
    StopRequested,
    TimeBudget,
    anchor_value,
    check_stop,
    job_end_time,
)
from a2tgpo.tracking import read_metrics
from a2tgpo.train import rl
from a2tgpo.train.checkpoint import latest_checkpoint, list_checkpoints
from a2tgpo.train.config import ScheduleConfig
from a2tgpo.train.rl import ROLLOUT_TIMES

pytestmark = pytest.mark.slow

STEPS = 5
# validation at steps 2 and 4 (and 5, the last); checkpoints at 0, 5 and where a stop saves
SCHEDULE = ScheduleConfig(steps=STEPS, prompts_per_step=2, mini_batch_prompts=1,
                          micro_batch_size=4, eval_every=2, eval_questions=4, save_every=10,
                          keep_last=10)

# the rollout's wall-clock numbers (rl.ROLLOUT_TIMES), like time/*
ROLLOUT_WALL_CLOCK = tuple(f"rollout/{k}" for k in ROLLOUT_TIMES)


def _config(toy_train_config, run_dir, **kw):
    method = dataclasses.replace(METHODS["grpo"], rollout=dataclasses.replace(
        METHODS["grpo"].rollout, n=4))
    return toy_train_config(run_dir, method, schedule=SCHEDULE, lr=3e-3, **kw)


def _weights(run_dir):
    from safetensors.torch import load_file

    ckpt = latest_checkpoint(run_dir)
    return ckpt.name, load_file(ckpt / "model" / "model.safetensors")


def _rows(run_dir):
    """Every step's logged values merged (a validation the stop cut short is logged by the
    rerun as a row of its own), without wall-clock values."""
    rows = {}
    for row in read_metrics(run_dir):
        rows.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items()
             if k != "time" and not k.startswith(("time/", "throughput/", "val/seconds",
                                           *ROLLOUT_WALL_CLOCK))})
    return rows


@pytest.fixture(scope="module")
def straight(toy_train_config, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    rl.train(_config(toy_train_config, run_dir))
    return run_dir


def _signal_self():
    os.kill(os.getpid(), signal.SIGTERM)


def _assert_resumes_exactly(cfg, run_dir, straight):
    rl.train(cfg)  # the rerun
    name_a, a = _weights(straight)
    name_b, b = _weights(run_dir)
    assert name_a == name_b == f"step_{STEPS:06d}"
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    rows_a, rows_b = _rows(straight), _rows(run_dir)
    assert sorted(rows_a) == sorted(rows_b) == list(range(STEPS + 1))
    for step in rows_a:
        assert rows_a[step] == rows_b[step], f"step {step} metrics differ"


@pytest.mark.expensive  # ~17 s each and their shared straight run ~15 s: CI's expensive step
def test_stop_during_rollouts_abandons_the_step(toy_train_config, straight, tmp_path,
                                                monkeypatch, caplog):
    cfg = _config(toy_train_config, tmp_path / "run")
    rollout, sent = rl.rollout, []

    def signalled_rollout(cfg_, questions, engine, tool, *, seed, greedy=False):
        if not greedy:
            if len(sent) == 2:  # step 3's rollouts, after its questions were drawn
                _signal_self()
            sent.append(seed)
        return rollout(cfg_, questions, engine, tool, seed=seed, greedy=greedy)

    monkeypatch.setattr(rl, "rollout", signalled_rollout)
    with pytest.raises(SystemExit) as stopped:
        rl.train(cfg)
    assert stopped.value.code == EXIT_PREEMPTED
    # step 3 was abandoned at its first wave (tests/rollout/test_agent.py: between waves): the
    # newest checkpoint is step 2, written by the stop (save_every is 10) from step 3's
    # starting state (data order and RNG states as they were before step 3 drew anything)
    assert [p.name for p in list_checkpoints(cfg.run_dir)] == ["step_000000", "step_000002"]
    assert "step 3 abandoned" in caplog.text
    assert max(r["step"] for r in read_metrics(cfg.run_dir)) == 2
    monkeypatch.setattr(rl, "rollout", rollout)
    _assert_resumes_exactly(cfg, cfg.run_dir, straight)


@pytest.mark.expensive  # ~17 s each and their shared straight run ~15 s: CI's expensive step
def test_stop_during_validation_saves_the_step_and_validates_it_on_resume(
        toy_train_config, straight, tmp_path, monkeypatch):
    cfg = _config(toy_train_config, tmp_path / "run")
    validate = rl.validate

    def signalled_validate(run, step):
        if step == 4:
            _signal_self()  # before its first wave
        return validate(run, step)

    monkeypatch.setattr(rl, "validate", signalled_validate)
    with pytest.raises(SystemExit) as stopped:
        rl.train(cfg)
    assert stopped.value.code == EXIT_PREEMPTED
    assert latest_checkpoint(cfg.run_dir).name == "step_000004"
    rows = _rows(cfg.run_dir)
    assert max(rows) == 4 and "train/reward" in rows[4] and "val/em" not in rows[4]
    monkeypatch.setattr(rl, "validate", validate)
    _assert_resumes_exactly(cfg, cfg.run_dir, straight)


@pytest.mark.expensive  # ~17 s each and their shared straight run ~15 s: CI's expensive step
def test_time_budget_stops_before_a_step_that_would_not_fit(toy_train_config, straight,
                                                            tmp_path, monkeypatch):
    # the job "ends" stop_margin_s from now: the first step runs (nothing measured yet); after
    # it, its own duration no longer fits before the margin, so the job stops at step 1
    cfg = _config(toy_train_config, tmp_path / "run", stop_margin_s=3600.0)
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time() + 3600)))
    with pytest.raises(SystemExit) as stopped:
        rl.train(cfg)
    assert stopped.value.code == EXIT_PREEMPTED
    assert latest_checkpoint(cfg.run_dir).name == "step_000001"
    monkeypatch.delenv("SLURM_JOB_END_TIME")
    _assert_resumes_exactly(cfg, cfg.run_dir, straight)


def test_a_job_whose_snakemake_ends_checkpoints_and_exits(toy_train_config, tmp_path):
    # `a2tgpo train` as the workflow starts it, anchored to a stand-in for Snakemake; killing
    # the stand-in mid-training must stop the job as a SIGTERM does (checkpoint, exit 75), not
    # leave it writing its run folder unseen. Far more steps than it can run before the
    # watcher (polling every ANCHOR_POLL_S = 2 s) notices: at 5 steps a fast machine (0.3 s a
    # step) finished first. Exact resumption after a stop is the tests above.
    from a2tgpo.config import dump_config

    steps = 500
    cfg = _config(toy_train_config, tmp_path / "run")
    cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, steps=steps))
    dump_config(cfg, tmp_path / "cell.yaml")
    snakemake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    job = subprocess.Popen(
        [sys.executable, "-m", "a2tgpo.cli", "train", str(tmp_path / "cell.yaml")],
        env={**os.environ, ANCHOR_ENV: anchor_value(snakemake.pid)},  # threads as in `straight`
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.exists() and any(r["step"] >= 1 for r in read_metrics(cfg.run_dir))):
            assert job.poll() is None, job.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step logged after 5 minutes"
            time.sleep(0.05)
        snakemake.kill()
        snakemake.wait()
        _, err = job.communicate(timeout=300)
    finally:
        snakemake.kill()
        job.kill()
    assert job.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "the process that started this job" in err and "has ended" in err
    # it stopped early, with a checkpoint of the last step it logged (save_every is 10: the
    # stop saved it)
    stopped = int(latest_checkpoint(cfg.run_dir).name.split("_")[1])
    assert 1 <= stopped < steps
    assert stopped == max(r["step"] for r in read_metrics(cfg.run_dir))


# --------------------------------------------------------------------------------------------
# the parts, without training


def test_handler_requests_a_stop_that_safe_points_raise_and_exit_clears():
    with PreemptionHandler() as handler:
        check_stop()  # nothing requested yet
        _signal_self()
        deadline = time.monotonic() + 5
        while not handler.requested and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(StopRequested, match="SIGTERM"):
            check_stop()
    check_stop()  # cleared with the handler


def test_time_budget_arithmetic():
    now = [1000.0]
    budget = TimeBudget(60.0, end_time=lambda: 1300.0, clock=lambda: now[0], window=2)
    assert budget.next_step_fits()  # nothing measured yet
    budget.step_took(100.0)
    budget.save_took(30.0)
    assert budget.next_step_fits()  # 100 + 30 + 60 = 190 <= 300 left
    now[0] = 1111.0                  # 189 left
    assert not budget.next_step_fits()
    budget.step_took(10.0)
    budget.step_took(10.0)           # the window (2) forgets the 100 s step: 10 + 30 + 60 <= 189
    assert budget.next_step_fits()
    assert TimeBudget(60.0, end_time=lambda: None).next_step_fits()  # no deadline


def test_job_end_time_from_the_environment():
    assert job_end_time({"SLURM_JOB_END_TIME": "1796140000"}) == 1796140000.0
    assert job_end_time({}) is None  # not a SLURM job
