"""The RL recipe on the toy world: every method id runs 2 optimizer updates after a short
warm-start, with finite losses, and changes every trainable parameter tensor."""

import dataclasses
import json
import math

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.train.config import ScheduleConfig

pytestmark = pytest.mark.slow

# one method per estimator / rollout shape runs in the default suite; all of them with -m expensive
REPRESENTATIVE = {"react", "grpo", "dapo", "gspo", "igpo", "a2tgpo", "gigpo", "aepo",
                  "tree_grpo", "at2po"}


def small(method):
    """The same method at a CPU test's size: fewer rollouts, the same code path."""
    r = method.rollout
    shapes = {"chains": dict(n=4), "tree_random": dict(n=4, tree_m=2, tree_n=1, tree_l=1,
                                                       tree_k=2),
              "tree_entropy": dict(n=5, tree_m=3, tree_l=1, tree_k=2),
              "aepo": dict(n=4, aepo_initial=2)}
    # DAPO's overlong buffer (2000 of 6192 in the paper) scaled to this test's 400 tokens
    d = dataclasses.replace(method.dapo, max_num_gen_batches=20,
                            overlong_buffer=min(method.dapo.overlong_buffer, 100))
    return dataclasses.replace(method, rollout=dataclasses.replace(r, **shapes[r.shape]), dapo=d)


@pytest.mark.parametrize("method_id", [
    m if m in REPRESENTATIVE else pytest.param(m, marks=pytest.mark.expensive)
    for m in sorted(METHODS)])
def test_two_updates_change_every_parameter(toy, toy_train_config, method_id, tmp_path):
    from a2tgpo.model.backbone import load_model
    from a2tgpo.train.rl import train

    root = toy[0]
    backbone = BackboneConfig(id="toy", path=str(root / "sft"), dtype="float32")
    cfg = toy_train_config(
        tmp_path / "run", small(METHODS[method_id]),
        schedule=ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=1,
                                micro_batch_size=4, eval_every=1, eval_questions=2,
                                save_every=1))
    train(cfg)
    start = load_model(backbone).state_dict()
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    final = load_model(BackboneConfig(id="toy", path=str(ckpts[-1] / "model"),
                                      dtype="float32")).state_dict()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    train_rows = [r for r in rows if "loss/total" in r]
    if not METHODS[method_id].train:  # ReAct: evaluation only, the weights stay as they were
        assert not train_rows
        assert all(torch.equal(start[k], final[k]) for k in start)
        return
    assert len(train_rows) == 1 and math.isfinite(train_rows[0]["loss/total"])
    # the newest two checkpoints (schedule.optimizer_states) keep the optimizer state, with
    # its hashes (test_checkpoint.py: older ones drop it)
    assert [c.name for c in ckpts] == ["step_000000", "step_000001"]
    assert all((c / "backend" / "sha256.json").is_file() for c in ckpts)
    assert (ckpts[0] / "model" / "model.safetensors").is_file()
    assert train_rows[0]["rollout/trajectories"] >= 2
    # where the rollout's time went (rl.ROLLOUT_TIMES): the engine worked, trajectories ended
    row = train_rows[0]
    assert 0 < row["rollout/engine_busy"] <= 1 and row["rollout/seconds"] > 0
    assert 0 < row["rollout/longest_trajectory_s"] <= row["rollout/seconds"]
    unchanged = [k for k in start if torch.equal(start[k], final[k])]
    assert not unchanged, f"{method_id}: parameters not updated: {unchanged}"


def test_start_run_applies_gradient_checkpointing(toy_train_config, tmp_path):
    from a2tgpo.train.rl import start_run

    schedule = ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=1,
                              micro_batch_size=4)
    for on in (False, True):
        cfg = toy_train_config(tmp_path / f"run{on}", METHODS["grpo"], schedule=schedule,
                               gradient_checkpointing=on)
        run = start_run(cfg)
        assert run.backend.unwrapped.is_gradient_checkpointing == on


# tolerance 1 (the run goes on) costs a minute more: -m expensive; test_step.py checks the skip
@pytest.mark.parametrize("tolerated", [0, pytest.param(1, marks=pytest.mark.expensive)])
def test_a_non_finite_step_stops_training_unless_tolerated(toy_train_config, tmp_path,
                                                           monkeypatch, tolerated):
    """Step 2's updates report a NaN gradient norm (as a NaN loss would make them): with
    max_nonfinite_steps 0 training stops there with an error, nothing of step 2 saved; with 1
    that step's updates are skipped and training goes on."""
    import a2tgpo.train.rl as rl
    from a2tgpo.tracking import read_metrics

    real = rl.update_policy
    calls = []

    def nan_at_step_2(*args, **kwargs):
        log = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            log.grad_norms = [float("nan")] * len(log.grad_norms)
        return log

    monkeypatch.setattr(rl, "update_policy", nan_at_step_2)
    cfg = toy_train_config(
        tmp_path / "run", small(METHODS["grpo"]),
        schedule=ScheduleConfig(steps=3, prompts_per_step=2, mini_batch_prompts=1,
                                micro_batch_size=4, eval_every=3, eval_questions=2,
                                save_every=1, keep_last=5, max_nonfinite_steps=tolerated))
    ckpts = lambda: sorted(p.name for p in (tmp_path / "run/checkpoints").glob("step_*"))  # noqa: E731
    if tolerated == 0:
        with pytest.raises(rl.NonFiniteTraining, match=r"step 2: optim/grad_norm = nan .*"
                                                       r"newest checkpoint is step 1"):
            rl.train(cfg)
        assert ckpts() == ["step_000000", "step_000001"]
        rows = [r for r in read_metrics(tmp_path / "run") if "optim/grad_norm" in r]
        assert [r["step"] for r in rows] == [1, 2]  # the stopping step is on record
    else:
        rl.train(cfg)
        assert ckpts() == [f"step_00000{i}" for i in range(4)]
