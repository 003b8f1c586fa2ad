"""A training job resumes its run only when the run was trained from the same config and
inputs (a2tgpo/train/lineage.py): after a changed config or a changed input file it archives
the old run (nothing deleted) and trains from step 0, so the result is what a straight run of
the new config gives; after an operational change (checkpoints kept, stop margin) it resumes.
Toy GRPO runs of 2 steps, in process."""

import dataclasses
import hashlib
import json
import logging
import shutil

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from a2tgpo.algo.methods import METHODS
from a2tgpo.tracking import read_metrics
from a2tgpo.train import rl
from a2tgpo.train.checkpoint import latest_checkpoint
from a2tgpo.train.config import OptimConfig, ScheduleConfig
from a2tgpo.train.lineage import identity_changes

pytestmark = pytest.mark.slow

CELL = "backbone~toy/method~grpo/beta~0/seed~1"
SCHEDULE = ScheduleConfig(steps=2, prompts_per_step=2, mini_batch_prompts=1,
                          micro_batch_size=4, eval_every=2, eval_questions=4, save_every=2,
                          keep_last=4)


def _config(toy_train_config, results, **kw):
    method = dataclasses.replace(METHODS["grpo"], rollout=dataclasses.replace(
        METHODS["grpo"].rollout, n=4))
    cfg = toy_train_config(results / "runs" / CELL, method, schedule=SCHEDULE, lr=1e-3,
                           cell=CELL, **kw)
    return dataclasses.replace(cfg, results_dir=str(results))


def _weights(run_dir):
    from safetensors.torch import load_file

    return load_file(latest_checkpoint(run_dir) / "model" / "model.safetensors")


def _steps(run_dir):
    return [r["step"] for r in read_metrics(run_dir) if "train/reward" in r or r["step"] == 0]


def _archives(results):
    root = results / "archive" / CELL
    return sorted(root.iterdir()) if root.exists() else []


def test_identity_changes_name_each_compared_key():
    # a checkpoint's identity and a job's: the run folder, the checkpoints kept and the
    # tracking differ (operational, not reported), and steps grow (an extension, not
    # reported); lr differs, a method key is new, and the training file's hash differs
    saved = {"config": {"run_dir": "a", "optim": {"lr": 0.001}, "tracking": {"mlflow": True},
                        "schedule": {"steps": 8, "keep_last": 2}, "method": {}},
             "inputs": {"train_file": "ab" * 32, "dev_file": "cd" * 32}}
    now = {"config": {"run_dir": "b", "optim": {"lr": 0.003}, "tracking": {"mlflow": False},
                      "schedule": {"steps": 16, "keep_last": 3}, "method": {"x": 1}},
           "inputs": {"train_file": "ef" * 32, "dev_file": "cd" * 32}}
    assert identity_changes(saved, now) == [
        "method.x: <absent> -> 1", "optim.lr: 0.001 -> 0.003",
        "input train_file: sha256 abababababab -> efefefefefef"]
    assert identity_changes(saved, saved) == []
    # fewer steps than the checkpoint was trained for is another run
    assert identity_changes(now, saved) == [
        "method.x: 1 -> <absent>", "optim.lr: 0.003 -> 0.001", "schedule.steps: 16 -> 8",
        "input train_file: sha256 efefefefefef -> abababababab"]


@pytest.mark.expensive  # ~20 s on 2 cores: CI runs it in its expensive step (.ci/run)
def test_a_changed_config_archives_the_old_run_and_trains_afresh(toy_train_config, tmp_path):
    results = tmp_path / "results"
    old = _config(toy_train_config, results)
    rl.train(old)
    old_weights = _weights(old.run_dir)
    new = dataclasses.replace(old, optim=OptimConfig(lr=3e-3, weight_decay=0.0))
    rl.train(new)
    # the old run, whole, in the archive, with its own config and the reason
    [archive] = _archives(results)
    assert yaml.safe_load((archive / "config.yaml").read_text())["optim"]["lr"] == 0.001
    assert json.loads((archive / "superseded.json").read_text())["changes"] == [
        "optim.lr: 0.001 -> 0.003"]
    assert _steps(archive) == [0, 1, 2]
    old_ckpt = archive / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    from safetensors.torch import load_file
    assert all(torch.equal(load_file(old_ckpt)[k], v) for k, v in old_weights.items())
    # the new run: from step 0, exactly what a straight run of the new config gives
    straight = dataclasses.replace(new, run_dir=str(tmp_path / "straight"))
    rl.train(straight)
    assert _steps(new.run_dir) == [0, 1, 2]
    a, b = _weights(new.run_dir), _weights(straight.run_dir)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert any(not torch.equal(a[k], old_weights[k]) for k in a)  # lr 3e-3 is another run
    # the config.yaml in the run folder is the job's (the workflow's input), not the old one
    run_cfg = yaml.safe_load((results / "runs" / CELL / "config.yaml").read_text())
    assert run_cfg["optim"]["lr"] == 0.003


def test_a_changed_input_file_archives_the_old_run(toy_train_config, tmp_path):
    results = tmp_path / "results"
    base = _config(toy_train_config, results)
    train_file = tmp_path / "train.parquet"
    shutil.copy(base.train_file, train_file)
    cfg = dataclasses.replace(base, train_file=str(train_file))
    rl.train(cfg)
    before = hashlib.sha256(train_file.read_bytes()).hexdigest()
    # the same path, other questions
    pq.write_table(pq.read_table(train_file).slice(1), train_file)
    after = hashlib.sha256(train_file.read_bytes()).hexdigest()
    rl.train(cfg)
    [archive] = _archives(results)
    assert json.loads((archive / "superseded.json").read_text())["changes"] == [
        f"input train_file: sha256 {before[:12]} -> {after[:12]}"]
    assert _steps(cfg.run_dir) == [0, 1, 2]


def test_an_operational_change_resumes(toy_train_config, tmp_path, caplog):
    results = tmp_path / "results"
    cfg = _config(toy_train_config, results)
    rl.train(cfg)
    weights = _weights(cfg.run_dir)
    more = dataclasses.replace(cfg, stop_margin_s=60.0, schedule=dataclasses.replace(
        cfg.schedule, keep_last=5, optimizer_states=3))
    with caplog.at_level(logging.INFO, logger="a2tgpo.train.rl"):
        rl.train(more)
    assert _archives(results) == []
    assert "resumed from" in caplog.text
    assert _steps(cfg.run_dir) == [0, 1, 2]  # nothing trained again
    assert all(torch.equal(_weights(cfg.run_dir)[k], v) for k, v in weights.items())


def test_a_checkpoint_without_an_identity_resumes_with_a_warning(toy_train_config, tmp_path,
                                                                  caplog):
    # checkpoints saved before identities were recorded: the job cannot tell, and resumes
    results = tmp_path / "results"
    cfg = _config(toy_train_config, results)
    rl.train(cfg)
    meta_file = latest_checkpoint(cfg.run_dir) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["trainer_state"]["identity"]
    meta_file.write_text(json.dumps(meta))
    with caplog.at_level(logging.INFO, logger="a2tgpo.train.rl"):
        rl.train(dataclasses.replace(cfg, optim=OptimConfig(lr=3e-3, weight_decay=0.0)))
    assert _archives(results) == []
    assert "records no config" in caplog.text and "resumed from" in caplog.text


@pytest.mark.expensive  # ~20 s on 2 cores: CI runs it in its expensive step (.ci/run)
def test_more_steps_go_on_from_the_checkpoint(toy_train_config, tmp_path, caplog):
    # an extension: 2 steps, then the same config with 3; the third step is trained on top,
    # and the weights are those of a straight 3-step run (validation at 2 in both: eval_every)
    results = tmp_path / "results"
    cfg = _config(toy_train_config, results)
    rl.train(cfg)
    longer = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, steps=3))
    with caplog.at_level(logging.INFO, logger="a2tgpo.train.rl"):
        rl.train(longer)
    assert _archives(results) == [] and "resumed from" in caplog.text
    assert _steps(cfg.run_dir) == [0, 1, 2, 3]
    straight = dataclasses.replace(longer, run_dir=str(tmp_path / "straight"))
    rl.train(straight)
    a, b = _weights(cfg.run_dir), _weights(straight.run_dir)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
