"""`a2tgpo train` with backend deepspeed: 2 ranks through `a2tgpo launch`, the DAG's command
(CPU, gloo, ZeRO-2, the KL reference under ZeRO-3) on the toy world, then a resume from the
sharded checkpoint, then a SIGTERM to the launcher (a time limit) that both ranks stop on with
exit 75, and the rerun that finishes.

The update arithmetic of the split (rows rank::world, global counts, dp_size) is checked
against one process in test_distributed.py; here the whole recipe runs: each rank rolls out
its share of the questions, the batch is gathered (both ranks' trajectories appear in the
metrics), rank 0 alone writes the run folder, and every rank saves and reloads its optimizer
shard.
"""

import dataclasses
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.config import dump_config
from a2tgpo.tracking import read_metrics
from a2tgpo.train.checkpoint import latest_checkpoint
from a2tgpo.train.config import ScheduleConfig

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed")]

REPO = Path(__file__).resolve().parents[2]
PROMPTS, N = 2, 4


def _command(cfg_path: Path) -> tuple[list[str], dict]:
    """The DAG's command for backend deepspeed (workflow/rules/common.smk: train_command)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    script = Path(sys.executable).parent / "a2tgpo"  # the console script the DAG rule runs
    return [str(script), "launch", "--nproc", "2", "--", str(script), "train",
            str(cfg_path)], env


def _launch(cfg_path: Path) -> subprocess.CompletedProcess:
    cmd, env = _command(cfg_path)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.expensive  # ~70 s on 2 cores: CI runs it in its expensive step (.ci/run)
def test_two_rank_training_runs_gathers_and_resumes(toy_train_config, tmp_path):
    method = dataclasses.replace(METHODS["grpo"], rollout=dataclasses.replace(
        METHODS["grpo"].rollout, n=N))
    schedule = ScheduleConfig(steps=2, prompts_per_step=PROMPTS, mini_batch_prompts=1,
                              micro_batch_size=2, eval_every=2, eval_questions=4, save_every=1)
    # grpo's KL term through the reference partitioned over the ranks and the optimizer state
    # offloaded between updates, as config/paper.yaml (saves and resumes from that state)
    cfg = toy_train_config(tmp_path / "run", method, schedule=schedule, backend="deepspeed",
                           zero_stage=2, reference="zero3", offload_optimizer=True)
    dump_config(cfg, tmp_path / "cfg.yaml")
    done = _launch(tmp_path / "cfg.yaml")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]

    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2
    ckpt = latest_checkpoint(run)
    assert ckpt.name == "step_000002"
    shards = sorted(p.name for p in (ckpt / "backend" / "deepspeed").glob("*optim_states.pt"))
    assert len(shards) == 2, shards  # one optimizer shard per rank, in rank 0's checkpoint
    rows = {r["step"]: r for r in read_metrics(run)}
    for step in (1, 2):
        # the whole step's batch, gathered from both ranks' rollouts
        assert rows[step]["rollout/trajectories"] == PROMPTS * N
        assert math.isfinite(rows[step]["loss/total"])
        # the policy has moved from the reference by step 2 (lr 1e-3): a KL of exactly 0 there
        # would mean the reference pass returned the policy's own log-probs or nothing
        assert math.isfinite(rows[step]["loss/kl"]) and (step == 1 or rows[step]["loss/kl"] != 0)
    assert "val/em" in rows[2]

    from safetensors.torch import load_file

    start = load_file(Path(cfg.backbone.path) / "model.safetensors")
    end = load_file(ckpt / "model" / "model.safetensors")
    moved = [k for k in start if not torch.equal(start[k], end[k])]
    assert len(moved) == len(start), "every parameter tensor is trained"

    # one more step: both ranks load their shards from the step-2 checkpoint and go on
    dump_config(dataclasses.replace(cfg, schedule=dataclasses.replace(schedule, steps=3)),
                tmp_path / "cfg.yaml")
    more = _launch(tmp_path / "cfg.yaml")
    assert more.returncode == 0, (more.stdout + more.stderr)[-4000:]
    assert "resumed from" in more.stdout + more.stderr
    assert latest_checkpoint(run).name == "step_000003"
    assert read_metrics(run)[-1]["step"] == 3

    # a stop: SIGTERM to the launcher once step 4 is logged reaches both ranks, which agree
    # (at step 5's first rollout wave, or at its end), save and exit 75; the rerun finishes
    dump_config(dataclasses.replace(cfg, schedule=dataclasses.replace(schedule, steps=5)),
                tmp_path / "cfg.yaml")
    cmd, env = _command(tmp_path / "cfg.yaml")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while read_metrics(run)[-1]["step"] < 4:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 75, out[-4000:]
    assert latest_checkpoint(run).name in ("step_000004", "step_000005"), out[-4000:]
    assert not (run / "summary.json").read_text().count('"steps": 5')
    final = _launch(tmp_path / "cfg.yaml")
    assert final.returncode == 0, (final.stdout + final.stderr)[-4000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 5
    assert sorted({r["step"] for r in read_metrics(run)}) == list(range(6))
