"""Tracker: metrics.jsonl contents, the MLflow run (tags, params, history, artifact, status),
resume and attach by run id, tracking failures that must not stop (or stall) the job, the
best-effort experiment rule, and `sync-mlflow` replaying what MLflow missed.

One sqlite store is shared by the module: creating it (schema migrations) is the slow part.
"""

import http.server
import json
import logging
import math
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from a2tgpo.cli import main
from a2tgpo.tracking import (
    RUN_LINK_FILE,
    Tracker,
    TrackingConfig,
    cut_after,
    ensure_experiment,
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


def test_experiment_is_a_model_training_experiment(store, tmp_path):
    # without mlflow.experimentKind the UI opens an experiment on its (empty) GenAI traces
    results, client = store
    assert client.get_experiment_by_name(STUDY).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    # an experiment made without the tag (an older store, or by hand) gets it on first use
    exp_id = client.create_experiment("untagged", artifact_location=tmp_path.as_uri())
    assert "mlflow.experimentKind" not in client.get_experiment(exp_id).tags
    assert init_experiment(TrackingConfig(), study="untagged", results_dir=results) == exp_id
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == \
        "custom_model_development"
    # a kind someone chose is left alone
    client.set_experiment_tag(exp_id, "mlflow.experimentKind", "finetuning")
    init_experiment(TrackingConfig(), study="untagged", results_dir=results)
    assert client.get_experiment(exp_id).tags["mlflow.experimentKind"] == "finetuning"


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

    with caplog.at_level(logging.WARNING):
        with tracker(run_dir, results, params={"beta": 0.2}) as t:
            t.log({"x": 1.0}, step=1)
    assert t.run_id == killed.run_id
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["beta"] == "0.1"  # params are immutable: the first value stays
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1]
    messages = " ".join(r.getMessage() for r in tracking_warnings(caplog))
    assert "keeps the first values of beta" in messages
    # the unfinished line was cut before the new rows, its 15 bytes kept beside the log
    assert "metrics.jsonl:2: cut an unfinished last line (15 bytes" in caplog.text
    assert (run_dir / "metrics.jsonl.partial").read_text() == '{"step": 1, "x"\n'


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


# ---- system metrics (mlflow's monitor) ---------------------------------------------------------


def _system_steps(client, run_id):
    return [p.step for p in client.get_metric_history(run_id, "system/cpu_utilization_percentage")]


def test_system_metrics_sample_the_machine_while_the_job_runs(store, tmp_path):
    results, client = store
    cfg = TrackingConfig(system_metrics_interval_s=0.2)
    with tracker(tmp_path / "cell", results, cfg) as t:
        start = time.time()
        time.sleep(1.2)
    # 1.2 s at 0.2 s: up to 6 windows from the monitor's thread (fewer on a busy machine: each
    # window also waits for a read of the run), then the last one at the stop
    steps = _system_steps(client, t.run_id)
    assert len(steps) >= 2 and steps == list(range(len(steps)))
    first = client.get_metric_history(t.run_id, "system/cpu_utilization_percentage")[0]
    assert first.timestamp >= int(start * 1000)  # logged while the job ran, not replayed
    assert {"system/system_memory_usage_megabytes", "system/disk_usage_megabytes",
            "system/network_receive_megabytes"} <= set(client.get_run(t.run_id).data.metrics)


def test_a_job_shorter_than_one_interval_logs_its_window_and_a_rerun_follows(store, tmp_path):
    results, client = store
    cfg = TrackingConfig(system_metrics_interval_s=3600)
    with tracker(tmp_path / "cell", results, cfg) as first:
        first.log({"x": 0.0}, step=0)
    with tracker(tmp_path / "cell", results, cfg) as second:  # resumes the same run
        second.log({"x": 1.0}, step=1)
    assert second.run_id == first.run_id
    # one point per job (the window mlflow's thread drops at the stop), the rerun's after
    assert _system_steps(client, first.run_id) == [0, 1]


def test_system_metrics_off_logs_none(store, tmp_path):
    results, client = store
    cfg = TrackingConfig(system_metrics=False, system_metrics_interval_s=0.2)
    with tracker(tmp_path / "cell", results, cfg) as t:
        t.log({"x": 0.0}, step=0)
        time.sleep(0.5)  # two of the intervals it would sample at
    metrics = client.get_run(t.run_id).data.metrics
    assert "x" in metrics and not [k for k in metrics if k.startswith("system/")]


def test_read_metrics_ignores_truncated_last_line_only(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x": 2.0}\n{"step": 2, "x"')
    with caplog.at_level(logging.WARNING, logger="a2tgpo.io"):
        assert read_metrics(tmp_path) == [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    (warning,) = caplog.records
    assert "metrics.jsonl:3: skipping an unfinished last line" in warning.getMessage()
    # a line cut inside a UTF-8 character (the first byte of "é") is unfinished too
    path.write_bytes(b'{"step": 0}\n{"q": "\xc3')
    assert read_metrics(tmp_path) == [{"step": 0}]
    path.write_text('{"step": 0}\n{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not valid JSON"):
        read_metrics(tmp_path)
    path.write_text('{"step": 0}\n{"step": 1\n')  # a whole last line: damage, not a cut
    with pytest.raises(ValueError, match="metrics.jsonl:2: not valid JSON"):
        read_metrics(tmp_path)
    path.write_text('{"step": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON object"):
        read_metrics(tmp_path)


def test_cut_after_keeps_the_steps_up_to_the_checkpoint(tmp_path):
    # a job that checkpointed step 2, then logged steps 3 and 4 and died writing step 5; its
    # step 2 has a second row (a validation finished by a resumed job)
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "x": 1}\n{"step": 2, "v": 1}\n'
                    '{"step": 3}\n{"step": 4}\n{"step": 5, "x"')
    assert cut_after(path, 2) == 3  # steps 3, 4 and the truncated line
    assert path.read_text() == ('{"step": 0}\n{"step": 1}\n{"step": 2, "x": 1}\n'
                                '{"step": 2, "v": 1}\n')
    assert (tmp_path / "metrics.jsonl.partial").read_text() == '{"step": 5, "x"\n'
    inode = path.stat().st_ino
    assert cut_after(path, 2) == 0 and path.stat().st_ino == inode  # nothing to cut: untouched
    assert cut_after(path, None) == 4 and path.read_text() == ""  # no checkpoint: all redone
    assert cut_after(tmp_path / "rollouts.jsonl", 3) == 0  # no file


def test_cut_after_rejects_a_damaged_log_and_leaves_it_as_it_was(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    for text, error in (('{"step": 0}\n{"step": 1\n{"step": 2}\n', "rollouts.jsonl:2"),
                        ('{"step": 0}\n{"x": 1}\n', 'rollouts.jsonl:2: a row without "step"')):
        path.write_text(text)
        with pytest.raises(ValueError, match=error):
            cut_after(path, 0)
        assert path.read_text() == text


def test_cut_after_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch):
    # a write that fails half-way (a full disk) leaves the old log, not half of the new one
    path = tmp_path / "metrics.jsonl"
    text = "".join(f'{{"step": {i}}}\n' for i in range(5))
    path.write_text(text)
    write = type(path).write_text

    def half_then_full(self, data, *a, **kw):
        write(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(path), "write_text", half_then_full)
    with pytest.raises(OSError):
        cut_after(path, 1)
    monkeypatch.undo()
    assert path.read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


@pytest.mark.parametrize("bad", [{"log_every": 0}, {"timeout_s": 0.0}, {"timeout_s": -1.0},
                                 {"timeout_s": math.nan}, {"timeout_s": math.inf},
                                 {"system_metrics_interval_s": 0.0},
                                 {"system_metrics_interval_s": math.nan}])
def test_config_rejects_nonpositive_log_every_and_timeout(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        TrackingConfig(**bad)


def test_import_is_cheap():
    # importing mlflow costs about a second; a job with mlflow off must never pay it
    code = "import sys, a2tgpo.tracking; assert 'mlflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- a tracking server that is down or breaks must not stall the job ---------------------------

MLFLOW_HTTP_ENV = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                   "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER")


@pytest.fixture
def http_attempts(monkeypatch):
    """Every HTTP attempt of the test, retries included, as (path, connect timeout, read
    timeout); the environment starts without mlflow's HTTP settings (mlflow's defaults)."""
    from urllib3.connectionpool import HTTPConnectionPool

    for name in MLFLOW_HTTP_ENV:
        monkeypatch.delenv(name, raising=False)
    attempts = []
    urlopen = HTTPConnectionPool.urlopen  # urllib3 retries by calling urlopen again

    def spy(self, method, url, *args, **kwargs):
        timeout = kwargs["timeout"]
        attempts.append((url.split("?")[0], timeout.connect_timeout, timeout.read_timeout))
        return urlopen(self, method, url, *args, **kwargs)

    monkeypatch.setattr(HTTPConnectionPool, "urlopen", spy)
    return attempts


@pytest.fixture
def broken_server():
    """(uri, API paths requested) of an HTTP server whose /health answers 200 and every other
    path 503: a tracking server whose store broke after the job's probe."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            if path != "/health":
                hits.append(path)
            self.send_response(200 if path == "/health" else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    server.server_close()


def test_dead_server_costs_one_probe_then_one_warning(tmp_path, caplog, http_attempts):
    uri = f"http://127.0.0.1:{_closed_port()}"
    cfg = TrackingConfig(tracking_uri=uri, log_every=1, timeout_s=2.0)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        with tracker(tmp_path / "cell", tmp_path, cfg) as t:
            for step in range(3):
                t.log({"x": float(step)}, step=step)
            t.summary({"x": 2.0})
    print(f"a dead tracking URI cost the job {time.monotonic() - start:.2f} s")
    # one request, no retries, so the job waits at most timeout_s (mlflow's defaults: 8 tries
    # of up to 120 s with backoff, about 4 minutes against a closed port)
    assert http_attempts == [("/health", 2.0, 2.0)]
    (warning,) = tracking_warnings(caplog)
    assert f"tracking server {uri} unreachable" in warning.getMessage()
    assert "Connection refused" in warning.getMessage()
    assert [r["x"] for r in read_metrics(tmp_path / "cell")] == [0.0, 1.0, 2.0]
    assert json.loads((tmp_path / "cell" / "summary.json").read_text()) == {"x": 2.0}


@pytest.mark.parametrize("user_retries, tries", [(None, 3), ("1", 2)])
def test_mlflow_calls_get_the_job_timeout_and_retries(broken_server, http_attempts, tmp_path,
                                                      caplog, monkeypatch, user_retries, tries):
    uri, hits = broken_server
    # settings the environment has win: here no backoff, which keeps the test fast
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    if user_retries:
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", user_retries)
    cfg = TrackingConfig(tracking_uri=uri, log_every=1, timeout_s=1.2)
    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        with tracker(tmp_path / "cell", tmp_path, cfg) as t:
            t.log({"x": 0.0}, step=0)
    # tries: the first MLflow call (get the experiment) 1 + 2 retries, or 1 + the user's 1;
    # each with mlflow's whole-second timeout, rounded up: ceil(1.2) = 2 s
    assert hits == ["/api/2.0/mlflow/experiments/get-by-name"] * tries
    assert http_attempts == [("/health", 1.2, 1.2)] + [(hits[0], 2, 2)] * tries
    (warning,) = tracking_warnings(caplog)
    assert uri in warning.getMessage() and "503" in warning.getMessage()
    assert read_metrics(tmp_path / "cell")[0]["x"] == 0.0
    # the job's settings end with it; the user's stay
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ
    assert os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES") == user_retries
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "0"


# ---- the experiment rule is best effort ------------------------------------------------------


def test_experiment_rule_succeeds_with_a_dead_server(tmp_path, caplog):
    uri = f"http://127.0.0.1:{_closed_port()}"
    out, log_file = tmp_path / "mlflow/experiment.json", tmp_path / "logs/mlflow_experiment.log"
    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        record = ensure_experiment(TrackingConfig(tracking_uri=uri), study=STUDY,
                                   results_dir=tmp_path, out=out, log_file=log_file)
    assert json.loads(out.read_text()) == record
    assert record["created"] is False and record["experiment_id"] is None
    assert uri in record["error"] and "Connection refused" in record["error"]
    assert log_file.read_text().startswith(f"WARNING: MLflow experiment 'unit' not created in "
                                           f"{uri} (TrackingUnreachable: ")
    (warning,) = tracking_warnings(caplog)
    assert "training goes on" in warning.getMessage()


def test_experiment_rule_records_the_experiment(store, tmp_path):
    results, client = store
    record = ensure_experiment(TrackingConfig(), study=STUDY, results_dir=results,
                               out=tmp_path / "experiment.json")
    assert record == {"experiment": STUDY, "created": True, "error": None,
                      "experiment_id": client.get_experiment_by_name(STUDY).experiment_id,
                      "tracking_uri": resolve_tracking_uri(TrackingConfig(), results)}


# ---- sync-mlflow: what MLflow missed, from the jobs' files -----------------------------------


def test_sync_uploads_a_metrics_only_cell_once(store, tmp_path, capsys, caplog):
    results, client = store
    dead = TrackingConfig(tracking_uri=f"http://127.0.0.1:{_closed_port()}", log_every=1)
    config = tmp_path / "config.yaml"
    config.write_text("algo:\n  beta: 0.3\n")
    cell = tmp_path / "runs" / "cell"
    with tracker(cell, tmp_path, dead, tags={"method": "igpo", "stage": "train"},
                 params={"algo": {"beta": 0.3}}, config_file=config) as train:
        for step in range(3):
            train.log({"reward": step / 2, "kl": float("nan")}, step=step)
        train.log({"reward": 1.5}, step=2)  # a resumed job's row of step 2
        train.summary({"em": {"avg": 0.4}})
    with Tracker.attach(cell, dead, results_dir=tmp_path, out_dir=cell / "eval" / "tracking",
                        tags={"stage": "eval"}) as ev:
        ev.summary({"test": {"nq": {"em": 0.5}}})
    old = tmp_path / "runs" / "old"  # metrics without a record: reported, not synced
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 0, "time": 1.0, "x": 1}\n')
    assert not train.mlflow_enabled and not (cell / RUN_LINK_FILE).exists()

    uri = resolve_tracking_uri(TrackingConfig(), results)
    assert main(["sync-mlflow", str(tmp_path / "runs"), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    run_id = json.loads((cell / RUN_LINK_FILE).read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.run_name == "cell" and run.info.status == "FINISHED"
    # the evaluation's stage tag wins, as it would have live
    assert run.data.tags["method"] == "igpo" and run.data.tags["stage"] == "eval"
    assert run.data.params == {"algo.beta": "0.3"}
    assert history(client, run_id, "reward") == [(0, 0.0), (1, 0.5), (2, 1.5)]  # later row wins
    assert history(client, run_id, "kl") == []  # null in the jsonl
    assert history(client, run_id, "em/avg") == [(2, 0.4)]  # at the job's last step
    assert history(client, run_id, "test/nq/em") == [(0, 0.5)]
    assert [a.path for a in client.list_artifacts(run_id)] == ["config.yaml"]
    # 3 reward points (steps 0, 1, 2) + em/avg + test/nq/em = 5
    assert "2 jobs synced into 1 runs (1 created), 5 points uploaded, 0 already there; " \
           "0 complete, 1 skipped, 0 failed" in out
    assert f"skipped  {old}: metrics.jsonl without tracker.json" in out

    assert main(["sync-mlflow", str(tmp_path / "runs"), "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "0 jobs synced into 0 runs (0 created), 0 points uploaded, 5 already there; " \
           "2 complete" in out
    assert history(client, run_id, "reward") == [(0, 0.0), (1, 0.5), (2, 1.5)]
    assert client.get_run(run_id).data.tags["stage"] == "eval"


def test_sync_adds_only_what_a_partly_logged_run_lacks(store, tmp_path, monkeypatch, capsys):
    results, client = store

    def locked(*args, **kwargs):
        raise RuntimeError("database is locked")

    cell = tmp_path / "cell"
    with tracker(cell, results, TrackingConfig(log_every=1)) as t:
        t.log({"x": 0.0}, step=0)
        monkeypatch.setattr(t._client, "log_batch", locked)
        t.log({"x": 1.0}, step=1)
        t.log({"x": 2.0}, step=2)
    assert client.get_run(t.run_id).info.status == "RUNNING"
    assert main(["sync-mlflow", str(cell)]) == 0  # into the job's own store
    out = capsys.readouterr().out
    assert history(client, t.run_id, "x") == [(0, 0.0), (1, 1.0), (2, 2.0)]  # step 0 once
    assert client.get_run(t.run_id).info.status == "FINISHED"
    assert "1 jobs synced into 1 runs (0 created), 2 points uploaded, 1 already there" in out


def test_sync_reports_damaged_jobs_and_syncs_the_others(store, tmp_path, capsys):
    """A tracker.json cut in half, one that is not a record, and a metrics.jsonl damaged in
    the middle: each job is reported FAILED with its file (and line) and the command exits 1,
    after syncing the healthy job."""
    results, client = store
    runs = tmp_path / "runs"
    for name in ("cut", "list", "bad_metrics", "good"):
        with tracker(runs / name, tmp_path, TrackingConfig(mlflow=False)) as t:
            t.log({"x": 0.0}, step=0)
            t.log({"x": 1.0}, step=1)
    record = (runs / "cut" / "tracker.json").read_text()
    (runs / "cut" / "tracker.json").write_text(record[: len(record) // 2])
    (runs / "list" / "tracker.json").write_text("[]\n")
    metrics = runs / "bad_metrics" / "metrics.jsonl"
    metrics.write_text(metrics.read_text().replace('"x": 0.0', '"x": 0.'))  # line 1 of 2

    uri = resolve_tracking_uri(TrackingConfig(), results)
    assert main(["sync-mlflow", str(runs), "--tracking-uri", uri]) == 1
    out = capsys.readouterr().out
    assert f"FAILED   {runs / 'cut'}: {runs / 'cut' / 'tracker.json'}: damaged: not valid " \
           "JSON" in out
    assert f"FAILED   {runs / 'list'}: {runs / 'list' / 'tracker.json'}: damaged: a JSON " \
           "list, not an object" in out
    assert f"FAILED   {runs / 'bad_metrics'}: JsonLinesError: {metrics}:1: not valid JSON" in out
    assert "1 jobs synced into 1 runs (1 created), 2 points uploaded" in out
    assert out.rstrip().endswith("0 skipped, 3 failed")
    run_id = json.loads((runs / "good" / RUN_LINK_FILE).read_text())["run_id"]
    assert history(client, run_id, "x") == [(0, 0.0), (1, 1.0)]


def test_a_damaged_record_is_moved_aside_and_the_job_goes_on(tmp_path, caplog):
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "tracker.json").write_text('{"study": "unit", "tags": {"a"')
    with caplog.at_level(logging.WARNING, logger="a2tgpo.tracking"):
        with tracker(cell, tmp_path, TrackingConfig(mlflow=False)) as t:
            t.log({"x": 0.0}, step=0)
    assert (cell / "tracker.json.damaged").read_text() == '{"study": "unit", "tags": {"a"'
    assert json.loads((cell / "tracker.json").read_text())["status"] == "FINISHED"
    (warning,) = tracking_warnings(caplog)
    assert f"{cell / 'tracker.json'}: damaged: not valid JSON" in warning.getMessage()


def test_sync_stops_when_the_store_does_not_answer(tmp_path, capsys):
    with tracker(tmp_path / "cell", tmp_path, TrackingConfig(mlflow=False)) as t:
        t.log({"x": 0.0}, step=0)
    uri = f"http://127.0.0.1:{_closed_port()}"
    assert main(["sync-mlflow", str(tmp_path), "--tracking-uri", uri]) == 1
    assert f"tracking server {uri} unreachable" in capsys.readouterr().err
    assert not (tmp_path / "cell" / RUN_LINK_FILE).exists()


# ---- dataset inputs and artifacts, live and replayed ----------------------------------------


def _dataset(name, digest, context):
    return {"name": name, "digest": digest, "source_type": "local",
            "source": json.dumps({"uri": f"/data/{name}.parquet"}),
            "profile": json.dumps({"rows": 3}), "context": context}


def _inputs(client, run_id):
    """{(name, digest): context} of a run's dataset inputs."""
    return {(i.dataset.name, i.dataset.digest): {t.key: t.value for t in i.tags}[
        "mlflow.data.context"] for i in client.get_run(run_id).inputs.dataset_inputs}


def test_dataset_inputs_are_logged_once_and_recorded(store, tmp_path):
    results, client = store
    train, test = _dataset("d/train", "aa11", "training"), _dataset("d/nq", "bb22", "test")
    with tracker(tmp_path / "cell", results) as t:
        t.log_inputs([train])
        t.log_inputs([train, test])  # train again: MLflow and the record keep one
        with pytest.raises(ValueError, match="dataset input 'x': no digest"):
            t.log_inputs([{"name": "x"}])
    assert _inputs(client, t.run_id) == {("d/train", "aa11"): "training",
                                         ("d/nq", "bb22"): "test"}
    run_input = client.get_run(t.run_id).inputs.dataset_inputs[0].dataset
    assert run_input.source_type == "local" and json.loads(run_input.profile) == {"rows": 3}
    record = json.loads((tmp_path / "cell" / "tracker.json").read_text())
    assert record["inputs"] == [train, test]


def test_sync_replays_an_offline_jobs_artifacts_and_inputs(store, tmp_path, capsys):
    results, client = store
    cell = tmp_path / "runs" / "cell"
    sample = tmp_path / "step_000001.json"
    sample.write_text('{"step": 1}')
    with tracker(cell, tmp_path, TrackingConfig(mlflow=False)) as t:
        t.log({"x": 0.0}, step=0)
        t.log_artifact(sample, "rollouts")
        t.log_inputs([_dataset("d/train", "cc33", "training")])
    uri = resolve_tracking_uri(TrackingConfig(), results)
    assert main(["sync-mlflow", str(cell), "--tracking-uri", uri]) == 0
    run_id = json.loads((cell / RUN_LINK_FILE).read_text())["run_id"]
    assert [a.path for a in client.list_artifacts(run_id, "rollouts")] == \
        ["rollouts/step_000001.json"]
    assert _inputs(client, run_id) == {("d/train", "cc33"): "training"}
    capsys.readouterr()
    assert main(["sync-mlflow", str(cell), "--tracking-uri", uri]) == 0
    assert "0 jobs synced into 0 runs" in capsys.readouterr().out  # the same size: present
    # a file the job rewrote since (a study's tables) has another size: sent again
    sample.write_text('{"step": 1, "rewritten": true}')
    assert main(["sync-mlflow", str(cell), "--tracking-uri", uri]) == 0
    assert "1 jobs synced into 1 runs (0 created)" in capsys.readouterr().out
    local = client.download_artifacts(run_id, "rollouts/step_000001.json", str(tmp_path))
    assert json.loads(open(local).read()) == {"step": 1, "rewritten": True}
