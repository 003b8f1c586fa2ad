"""A cell's MLflow run carries its evidence: after a 2-step training and the evaluation of its
selected checkpoint, against a real sqlite store, the run holds the config, a readable sample
of the training rollouts per logged step, the evaluation's predictions, records and best.json,
the training, dev and test files as dataset inputs, and the tag naming its study run; and
`sync-mlflow` replays all of it from the jobs' records into a store that never saw the run."""

import dataclasses
import hashlib
import json

import pytest

from a2tgpo.algo.methods import METHODS
from a2tgpo.tracking import RUN_LINK_FILE, TrackingConfig, resolve_tracking_uri, sync
from a2tgpo.train.config import ScheduleConfig

# a 2-step training and an evaluation: ~60 s on 2 CPU cores, after the toy fixture (CI's expensive
# step)
pytestmark = pytest.mark.expensive


def artifacts(client, run_id, path=None):
    """Every file of a run under `path`, recursively."""
    out = []
    for a in client.list_artifacts(run_id, path):
        out += artifacts(client, run_id, a.path) if a.is_dir else [a.path]
    return sorted(out)


def inputs(client, run_id):
    """{name: (digest, context, profile)} of a run's dataset inputs."""
    out = {}
    for i in client.get_run(run_id).inputs.dataset_inputs:
        tags = {t.key: t.value for t in i.tags}
        out[i.dataset.name] = (i.dataset.digest, tags["mlflow.data.context"],
                               json.loads(i.dataset.profile))
    return out


def test_a_cells_run_carries_its_evidence_and_sync_replays_it(toy, toy_train_config,
                                                              tmp_path):
    from mlflow import MlflowClient

    from a2tgpo.cli import main
    from a2tgpo.data.qa import load_split
    from a2tgpo.eval.evaluate import evaluate_best
    from a2tgpo.io import read_jsonl
    from a2tgpo.train.rl import train

    root = toy[0]
    run = tmp_path / "run"
    grpo = METHODS["grpo"]
    grpo = dataclasses.replace(grpo, rollout=dataclasses.replace(grpo.rollout, n=4))
    # 3 prompts x 4 chains = 12 trajectories (3 groups) a step; validation at steps 0 and 2
    cfg = toy_train_config(
        run, grpo, tracking=TrackingConfig(),
        schedule=ScheduleConfig(steps=2, prompts_per_step=3, mini_batch_prompts=3,
                                micro_batch_size=6, eval_every=2, eval_questions=2,
                                save_every=2))
    train(cfg)
    assert main(["select", str(run)]) == 0
    test_file = root / "data" / "test" / "tq.parquet"
    evaluate_best(cfg, run / "best.json", [test_file], run / "eval", progress=False)

    client = MlflowClient(tracking_uri=resolve_tracking_uri(cfg.tracking, tmp_path))
    run_id = json.loads((run / RUN_LINK_FILE).read_text())["run_id"]
    # config.yaml; rollouts of step 1 (the first) and step 2 (a validation step, the last);
    # per test set (tq) its predictions and record, then summary.json and best.json
    expected = ["config.yaml", "eval/best.json", "eval/summary.json", "eval/tq.json",
                "eval/tq.predictions.jsonl", "rollouts/step_000001.json",
                "rollouts/step_000002.json"]
    assert artifacts(client, run_id) == expected
    sample = json.loads((run / "rollout_samples" / "step_000002.json").read_text())
    # the first 2 of the step's 3 groups, 4 trajectories each: 8 of 12
    assert sample["step"] == 2 and sample["trajectories"] == 12
    assert len(sample["sample"]) == 8 and len({t["group"] for t in sample["sample"]}) == 2
    rows = {r["id"]: r for r in load_split(root / "data" / "train.parquet")}
    for t in sample["sample"]:  # the readable form: the question beside its turns
        q = rows[t["question_id"]]
        assert (t["question"], t["golden_answers"]) == (q["question"], q["golden_answers"])
        assert len(t["advantages"]) == len(t["turns"]) and isinstance(t["reward"], float)
        assert all("text" in x and "query" in x for x in t["turns"])
    local = client.download_artifacts(run_id, "eval/tq.predictions.jsonl", str(tmp_path / "d"))
    predictions = read_jsonl(local)
    assert len(predictions) == 6  # tq's dev split, the toy world's 6 test questions
    assert {"question", "golden_answers", "prediction", "em", "f1", "outcome"} <= \
        predictions[0].keys()

    def digest(path):
        return hashlib.sha256(path.read_bytes()).hexdigest()[:16]

    data = root / "data"
    # train: 40 tq + 20 tm training questions - 6 held out for dev = 54; dev 6; test tq 6
    want = {"data/train": (digest(data / "train.parquet"), "training", 54),
            "data/dev": (digest(data / "dev.parquet"), "validation", 6),
            "data/tq": (digest(test_file), "test", 6)}
    got = inputs(client, run_id)
    assert {k: (d, c, p["rows"]) for k, (d, c, p) in got.items()} == want
    source = root / "world" / "qa" / "tq" / "dev.jsonl"  # a local source: its path
    assert got["data/tq"][2]["from"] == [f"{source} (dev, 6 rows)"]
    assert client.get_run(run_id).data.tags["study_run"] == "study · toy"

    # the same jobs replayed from their records into a store that never saw them
    other = f"sqlite:///{tmp_path / 'other.db'}"
    report = sync([run], tracking_uri=other)
    assert [r.created for r in report.runs] == [True, False]  # training, then evaluation
    copy = MlflowClient(tracking_uri=other)
    new_id = json.loads((run / RUN_LINK_FILE).read_text())["run_id"]
    assert artifacts(copy, new_id) == expected
    assert inputs(copy, new_id) == got
    assert not any(r.changed for r in sync([run], tracking_uri=other).runs)  # nothing twice
