"""Tracker: metrics.jsonl contents, the MLflow run (tags, params, history, artifact, status),
resume and attach by run id, and tracking failures that must not stop the job.

One sqlite store is shared by the module: creating it (schema migrations) is the slow part.
"""

import json
import logging
import socket
import subprocess
import sys

import pytest

from a2tgpo.tracking import (
    RUN_LINK_FILE,
    Tracker,
    TrackingConfig,
    init_experiment,
    read_metrics,
    resolve_tracking_uri,
)

STUDY = "unit"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """(results_dir, MlflowClient) of a sqlite store with the study's experiment created."""
    from mlflow import MlflowClient

    results = tmp_path_factory.mktemp("results")
    init_experiment(TrackingConfig(), study=STUDY, results_dir=results)
    return results, MlflowClient(tracking_uri=resolve_tracking_uri(TrackingConfig(), results))


def tracker(run_dir, results, cfg=None, **kw):
    kw.setdefault("run_name", run_dir.name)
    cfg = cfg or TrackingConfig(log_every=2)
    return Tracker(run_dir, cfg, study=STUDY, results_dir=results, **kw)


def history(client, run_id, key):
    return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]


def tracking_warnings(caplog):
    return [r for r in caplog.records
            if r.name == "a2tgpo.tracking" and r.levelno == logging.WARNING]


def test_jsonl_rows_flatten_nested_and_write_nonfinite_as_null(tmp_path):
    with Tracker(tmp_path / "cell", TrackingConfig(mlflow=False), study=STUDY, run_name="c",
                 results_dir=tmp_path) as t:
        t.log({"loss": 0.5, "em": {"nq": 0.25, "hotpotqa": 1}, "kl": float("nan")}, step=0)
        t.log({"loss": float("inf")}, step=1)
        with pytest.raises(ValueError, match="reserved"):
            t.log({"time": 1.0}, step=2)
        assert not t.mlflow_enabled
    rows = read_metrics(tmp_path / "cell")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["loss"] == 0.5 and rows[0]["em/nq"] == 0.25 and rows[0]["em/hotpotqa"] == 1
    assert rows[0]["kl"] is None and rows[1]["loss"] is None
    assert all(isinstance(r["time"], float) for r in rows)
    assert not (tmp_path / "cell" / RUN_LINK_FILE).exists()


def test_mlflow_run_has_tags_params_history_artifact_and_finishes(store, tmp_path):
    results, client = store
    config = tmp_path / "config.yaml"
    config.write_text("algo:\n  beta: 0.3\n")
    params = {"algo": {"beta": 0.3, "clip": [0.2, 0.28]}, "prompt": "x" * 7000, "flag": True}
    run_dir = tmp_path / "toy" / "igpo" / "s0"
    with tracker(run_dir, results, tags={"method": "igpo", "seed": 0}, params=params,
                 config_file=config) as t:
        for step in range(3):
            t.log({"reward": step / 2, "kl": float("nan"), "em@1": 1.0}, step=step)
        t.summary({"em": {"avg": 0.4}})
        t.set_tags({"checkpoint": "step_2"})
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "s0"
    assert json.loads((run_dir / RUN_LINK_FILE).read_text())["run_id"] == t.run_id
    assert run.data.tags["method"] == "igpo" and run.data.tags["seed"] == "0"
    assert run.data.tags["checkpoint"] == "step_2"
    p = run.data.params
    assert p["algo.beta"] == "0.3" and p["algo.clip"] == "[0.2, 0.28]" and p["flag"] == "true"
    assert len(p["prompt"]) == 6000  # MLflow's value limit: truncated, not rejected
    assert history(client, t.run_id, "reward") == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert history(client, t.run_id, "kl") == []  # NaN stays out of MLflow
    assert history(client, t.run_id, "em_1") == [(0, 1.0), (1, 1.0), (2, 1.0)]  # '@' is invalid
    assert history(client, t.run_id, "em/avg") == [(2, 0.4)]
    assert json.loads((run_dir / "summary.json").read_text()) == {"em/avg": 0.4}
    assert [a.path for a in client.list_artifacts(t.run_id)] == ["config.yaml"]


def test_metrics_are_buffered_until_log_every(store, tmp_path):
    results, client = store
    with tracker(tmp_path / "cell", results, TrackingConfig(log_every=3)) as t:
        t.log({"x": 1.0}, step=0)
        t.log({"x": 2.0}, step=1)
        assert history(client, t.run_id, "x") == []
        assert len(read_metrics(tmp_path / "cell")) == 2  # the jsonl is never behind
        t.log({"x": 3.0}, step=2)
        assert len(history(client, t.run_id, "x")) == 3
        t.log({"x": 4.0}, step=3)
    assert len(history(client, t.run_id, "x")) == 4  # the exit flushes the rest


def test_exception_ends_run_failed_and_propagates(store, tmp_path):
    results, client = store
    with pytest.raises(RuntimeError, match="boom"):
        with tracker(tmp_path / "cell", results) as t:
            t.log({"x": 1.0}, step=0)
            raise RuntimeError("boom")
    assert client.get_run(t.run_id).info.status == "FAILED"
    assert history(client, t.run_id, "x") == [(0, 1.0)]  # buffered points are not lost


def test_interrupt_ends_run_killed(store, tmp_path):
    results, client = store
    with pytest.raises(KeyboardInterrupt):
        with tracker(tmp_path / "cell", results) as t:
            raise KeyboardInterrupt
    assert client.get_run(t.run_id).info.status == "KILLED"


def test_rerun_resumes_same_run_and_appends(store, tmp_path):
    results, client = store
    run_dir = tmp_path / "cell"
    with tracker(run_dir, results, params={"beta": 0.1}) as first:
        first.log({"x": 0.0}, step=0)
        first.log({"x": 1.0}, step=1)
    with tracker(run_dir, results, params={"beta": 0.1, "new": 1}) as second:
        second.log({"x": 2.0}, step=2)
    assert second.run_id == first.run_id
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]
    assert history(client, first.run_id, "x") == [(0, 0.0), (1, 1.0), (2, 2.0)]
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"beta": "0.1", "new": "1"}


def test_killed_job_leaves_running_run_that_next_start_resumes(store, tmp_path, caplog):
    results, client = store
    run_dir = tmp_path / "cell"
    killed = tracker(run_dir, results, TrackingConfig(log_every=1), params={"beta": 0.1})
    killed.__enter__()  # SIGKILL: no __exit__ ever runs
    killed.log({"x": 0.0}, step=0)
    killed._jsonl.write('{"step": 1, "x"')  # died mid-line
    killed._jsonl.close()
    assert client.get_run(killed.run_id).info.status == "RUNNING"

    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        with tracker(run_dir, results, params={"beta": 0.2}) as t:
            t.log({"x": 1.0}, step=1)
    assert t.run_id == killed.run_id
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["beta"] == "0.1"  # params are immutable: the first value stays
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    messages = " ".join(r.getMessage() for r in tracking_warnings(caplog))
    assert "truncated last line" in messages and "keeps the first values of beta" in messages


def test_attach_logs_evaluation_into_the_training_run(store, tmp_path):
    results, client = store
    run_dir = tmp_path / "cell"
    with tracker(run_dir, results) as train:
        train.log({"loss": 1.0}, step=5)
    with Tracker.attach(run_dir, TrackingConfig(), results_dir=results, out_dir=run_dir / "eval",
                        tags={"stage": "eval"}) as ev:
        ev.summary({"em": {"nq": 0.5, "avg": 0.5}})
    assert ev.run_id == train.run_id
    run = client.get_run(train.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["stage"] == "eval"
    assert run.data.metrics["em/nq"] == 0.5 and run.data.metrics["loss"] == 1.0
    assert json.loads((run_dir / "eval" / "summary.json").read_text())["em/avg"] == 0.5
    assert [r["step"] for r in read_metrics(run_dir)] == [5]  # the training jsonl is untouched


def test_attach_without_link_logs_jsonl_only(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        with Tracker.attach(tmp_path / "cell", TrackingConfig(), results_dir=tmp_path,
                            out_dir=tmp_path / "eval") as ev:
            ev.log({"em": 0.1}, step=0)
    assert not ev.mlflow_enabled and read_metrics(tmp_path / "eval")[0]["em"] == 0.1
    assert len(tracking_warnings(caplog)) == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("broken", ["server_down", "sqlite_path", "no_mlflow"])
def test_tracking_failure_warns_once_and_jsonl_goes_on(broken, tmp_path, caplog, monkeypatch):
    results = tmp_path / "results"
    cfg = TrackingConfig(log_every=1)
    if broken == "server_down":
        # mlflow's default retry schedule would take minutes before reporting the failure
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        cfg = TrackingConfig(tracking_uri=f"http://127.0.0.1:{_closed_port()}", log_every=1)
    elif broken == "sqlite_path":
        (tmp_path / "file").write_text("not a folder")
        cfg = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path}/file/mlflow.db", log_every=1)
    else:
        monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        with tracker(tmp_path / "cell", results, cfg) as t:
            for step in range(3):
                t.log({"x": float(step)}, step=step)
            t.summary({"x": 2.0})
            t.log_artifact(__file__)
    assert not t.mlflow_enabled
    assert [r["x"] for r in read_metrics(tmp_path / "cell")] == [0.0, 1.0, 2.0]
    (warning,) = tracking_warnings(caplog)
    assert "MLflow tracking off" in warning.getMessage()


def test_failure_mid_run_warns_once_and_jsonl_goes_on(store, tmp_path, caplog, monkeypatch):
    results, client = store

    def locked(*args, **kwargs):
        raise RuntimeError("database is locked")

    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        with tracker(tmp_path / "cell", results, TrackingConfig(log_every=1)) as t:
            t.log({"x": 0.0}, step=0)
            monkeypatch.setattr(t._client, "log_batch", locked)
            t.log({"x": 1.0}, step=1)
            t.log({"x": 2.0}, step=2)
    assert not t.mlflow_enabled and len(read_metrics(tmp_path / "cell")) == 3
    (warning,) = tracking_warnings(caplog)
    assert "logging metrics failed: RuntimeError: database is locked" in warning.getMessage()
    # the run stays RUNNING (the store is unusable); the cell's next start resumes and ends it
    assert client.get_run(t.run_id).info.status == "RUNNING"
    assert history(client, t.run_id, "x") == [(0, 0.0)]


def test_read_metrics_ignores_truncated_last_line_only(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x": 2.0}\n{"step": 2, "x"')
    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        assert read_metrics(tmp_path) == [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    assert len(tracking_warnings(caplog)) == 1
    path.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_metrics(tmp_path)


def test_config_rejects_nonpositive_log_every():
    with pytest.raises(ValueError, match="log_every"):
        TrackingConfig(log_every=0)


def test_import_is_cheap():
    # importing mlflow costs about a second; a job with mlflow off must never pay it
    code = "import sys, a2tgpo.tracking; assert 'mlflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
