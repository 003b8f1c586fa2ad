"""One logger for training, evaluation and sweeps: `metrics.jsonl` plus an MLflow run.

Every job writes `<out_dir>/metrics.jsonl` (one JSON object per `log` call, flushed at once, so a
killed job keeps what it logged); Snakemake rules, Optuna objectives and tests read only that file
(`read_metrics`). MLflow is the browsing layer on top: one experiment per study, one run per grid
cell, with the cell's wildcards as tags, the flattened resolved config as params and the resolved
config file as an artifact (DESIGN §3 "Tracking"); jobs add their evidence as artifacts
(`log_artifact`) and the data they read as MLflow dataset inputs (`log_inputs`), so the runs
table's Dataset column says what each run saw. The study's tables and plots have a run of their
own (`study_run_name`, tag kind=study: a2tgpo/report/study_run.py).

One cell, one run. The run id is kept in `<run_dir>/mlflow_run.json`, so a rerun of the cell
(resume after preemption, or after a kill left the run RUNNING) and the evaluation job
(`Tracker.attach`) log into the same run and the UI shows the whole cell in one row.

Tracking never stops training. Every MLflow call is guarded: the first failure (server down,
sqlite locked, mlflow not importable, ...) is logged once as a warning with its reason, MLflow is
switched off for the rest of the job, and metrics.jsonl keeps going.

A tracking server that is down must not stall a job either. Before its first MLflow call a job
probes an http(s) tracking URI (one request, `tracking.timeout_s`); and for the job's MLflow
calls, mlflow's retry settings are cut from its defaults (120 s per request, 7 retries with
backoff: about 4 minutes per failed call) to `timeout_s` per request and 2 retries about 2 s
apart (MLFLOW_HTTP_REQUEST_TIMEOUT, MLFLOW_HTTP_REQUEST_MAX_RETRIES and
MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR; where the environment sets one, it wins). A server down at
the start costs a job one probe (at most `timeout_s`); one that dies mid-run costs one failed
call (at most 3·`timeout_s` + 3 s).

What MLflow missed is not lost: every Tracker also writes `<out_dir>/tracker.json`, what it
logs besides the metrics (run name, tags, params, artifacts, dataset inputs, final status), and
`sync` (the `a2tgpo sync-mlflow` command) replays a job's tracker.json, metrics.jsonl and
summary.json into its MLflow run once the store is back, adding only what the run lacks.

System metrics: while a job's MLflow run is live, mlflow's system-metrics monitor (a thread of
the job, with a client of its own) logs the machine's CPU, memory, disk and network use, and
each GPU's through NVML where nvidia-ml-py is installed, as system/... points every
`system_metrics_interval_s`; the last, shorter window is logged when the job ends. They exist
only live: a job that logs to metrics.jsonl only has none, and `sync` has none to replay. What
jobs log through `summary` (their peak memory, a2tgpo.train.memory.job_peak) is replayed.

Run status: leaving the `with` block normally ends the run FINISHED; an `Exception` ends it FAILED
and a `KeyboardInterrupt`/`SystemExit` (SIGINT, or a SIGTERM handler that exits) ends it KILLED,
and the exception propagates. SIGKILL (and SIGTERM without a handler) cannot be caught: the run
stays RUNNING until the cell's next start resumes it by id and closes it properly.

`import mlflow` takes about a second, so it happens only when a Tracker starts with MLflow on.
A Tracker is not thread-safe; log from one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from a2tgpo.config import InvalidKey, from_dict, option, to_dict
from a2tgpo.io import atomic_write_json, atomic_write_text, cut_unfinished_line, iter_jsonl

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RUN_LINK_FILE = "mlflow_run.json"
RECORD_FILE = "tracker.json"

# characters MLflow accepts in metric and param names (mlflow.utils.validation); anything else
# would make the whole batch fail, so it becomes "_" in MLflow (metrics.jsonl keeps the original)
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")
# the columns of a metrics.jsonl row that are not metrics
_ROW_KEYS = ("step", "time")
# mlflow's HTTP retries for a job: 2 retries, the second after 2 s (+ up to 1 s jitter), so one
# failed call costs at most 3 * timeout_s + 3 s
_HTTP_RETRIES = 2
_HTTP_BACKOFF_FACTOR = 1

SYNC_HINT = "`a2tgpo sync-mlflow {}` uploads them once the store is back"

# the tag that marks a study's own run (its tables and plots), and the tag by which a cell's run
# names it: searching `tags.kind = 'study'` finds it, a cell's `study_run` column says which
KIND_TAG, STUDY_KIND, STUDY_RUN_TAG = "kind", "study", "study_run"
# MLflow's tag for what a dataset input was used for (mlflow.utils.mlflow_tags)
_DATASET_CONTEXT = "mlflow.data.context"
# the keys of a dataset input as `log_inputs` takes it and tracker.json keeps it
DATASET_KEYS = ("name", "digest", "source_type", "source", "profile", "context")


def study_run_name(study: str, grid_set: str | None = None) -> str:
    """The MLflow run name of a study's tables and plots (of one extra grid set's, if given);
    a cell's run names it in its `study_run` tag."""
    return f"study · {study}" if grid_set is None else f"study · {study} · set {grid_set}"


class TrackingUnreachable(RuntimeError):
    """An http(s) tracking server did not answer the probe."""


@dataclass(frozen=True)
class TrackingConfig:
    """Where and how a job's metrics are tracked (metrics.jsonl is always written)."""

    mlflow: bool = option(
        True, "Also log to MLflow (false: metrics.jsonl only, mlflow is never imported)."
    )
    tracking_uri: str | None = option(
        None,
        "MLflow tracking URI. null = sqlite:///<results_dir>/mlflow.db (absolute path). On a "
        "cluster use a tracking server (http://host:5000): sqlite over NFS locks badly.",
    )
    experiment: str | None = option(None, "MLflow experiment name; null = the study name.")
    artifact_location: str | None = option(
        None,
        "Artifact root of a newly created experiment. null = <results_dir>/mlartifacts with the "
        "default sqlite store, the store's own default otherwise. Ignored once the experiment "
        "exists.",
    )
    log_every: int = option(
        10,
        "Steps between MLflow metric flushes (buffered points are kept, not dropped); "
        "metrics.jsonl gets every step immediately.", ge=1
    )
    timeout_s: float = option(
        5.0,
        "Seconds an http(s) tracking server gets to answer: a job probes it once before its "
        "first MLflow call (no answer: MLflow is off for the job, metrics.jsonl goes on), and "
        "each MLflow request times out after this long (whole seconds, rounded up) with 2 "
        "retries, so a server that dies mid-run costs a job at most 3 x timeout_s + 3 s once. "
        "MLFLOW_HTTP_REQUEST_TIMEOUT, MLFLOW_HTTP_REQUEST_MAX_RETRIES and "
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR win where the environment sets them.", gt=0
    )
    system_metrics: bool = option(
        True,
        "Sample the machine's CPU, memory, disk and network use (and each GPU's use, memory and "
        "power, where nvidia-ml-py finds an NVIDIA driver) into the job's MLflow run as "
        "system/... metrics while the job runs: mlflow's system-metrics monitor, a thread of the "
        "job. Live MLflow only: a job that logs to metrics.jsonl only records none, and "
        "sync-mlflow has none to replay.",
    )
    system_metrics_interval_s: float = option(
        5.0,
        "Seconds between system-metrics samples; each is one MLflow point per metric (the last, "
        "shorter window is logged when the job ends). MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL "
        "wins where the environment sets it.", gt=0
    )

    def __post_init__(self) -> None:
        for key in ("tracking_uri", "experiment", "artifact_location"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise InvalidKey(key, "empty: write null for the default")
        if self.tracking_uri and (error := tracking_uri_error(self.tracking_uri)):
            raise InvalidKey("tracking_uri", error)
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got "
                             f"{self.timeout_s}")
        if not (math.isfinite(self.system_metrics_interval_s)
                and self.system_metrics_interval_s > 0):
            raise ValueError(f"system_metrics_interval_s must be a positive number of seconds, "
                             f"got {self.system_metrics_interval_s}")


# the URI schemes of the tracking stores mlflow registers (a test keeps this equal to mlflow's
# registry), "" being a local path; SQLAlchemy URIs may name a driver (postgresql+psycopg2)
MLFLOW_SCHEMES = ("", "file", "http", "https", "sqlite", "postgresql", "mysql", "mssql",
                  "databricks", "databricks-uc", "uc")


def tracking_uri_error(uri: str) -> str | None:
    """Why MLflow could open no tracking store at `uri` (None: it could try), read the way
    mlflow picks the store, without importing it: by the URI's scheme, a store plugin's
    (entry point group mlflow.tracking_store) included."""
    from importlib.metadata import entry_points

    scheme = urlsplit(uri).scheme.lower()
    if len(scheme) == 1 or scheme.split("+")[0] in MLFLOW_SCHEMES:  # C:\... is a path
        return None
    if scheme in {e.name for e in entry_points(group="mlflow.tracking_store")}:
        return None
    return (f"{uri!r}: MLflow has no tracking store for scheme {scheme}: (a path, file:, "
            "http(s):, sqlite:, postgresql:, mysql:, mssql: or databricks)")


def resolve_tracking_uri(cfg: TrackingConfig, results_dir: str | Path) -> str:
    """The tracking URI a job uses: `cfg.tracking_uri`, or the sqlite file under results_dir."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    # an absolute path gives four slashes, so the URI does not depend on the job's cwd
    return f"sqlite:///{Path(results_dir).resolve() / 'mlflow.db'}"


def http_settings(cfg: TrackingConfig) -> dict[str, str]:
    """mlflow's HTTP settings for a job (environment variables mlflow reads at each request)."""
    return {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(math.ceil(cfg.timeout_s)),  # mlflow reads an int
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(_HTTP_RETRIES),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": str(_HTTP_BACKOFF_FACTOR),
    }


def _is_http(uri: str) -> bool:
    return urlsplit(uri).scheme in ("http", "https")


def probe(uri: str, timeout_s: float) -> None:
    """Raise TrackingUnreachable unless the server at `uri` answers one request in timeout_s.

    Any HTTP answer counts (an MLflow server's /health says OK; a proxy's 404 or a 401 is for
    mlflow to report, which it does at once). No retries: a job that finds the server down goes
    on without MLflow, and `sync` uploads later.
    """
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s, allow_redirects=False).close()
    except requests.exceptions.SSLError:
        return  # a TLS server answered; its certificate is for mlflow's own settings to accept
    except requests.RequestException as e:
        # requests wraps urllib3's error, whose `reason` says what happened (refused, timed out)
        reason = getattr(e.args[0], "reason", None) if e.args else None
        reason = reason if isinstance(reason, BaseException) else e
        raise TrackingUnreachable(f"tracking server {uri} unreachable within {timeout_s:g} s "
                                  f"({type(reason).__name__}: {reason})") from e


@contextlib.contextmanager
def connection(cfg: TrackingConfig, uri: str) -> Iterator[None]:
    """MLflow calls to `uri` inside this block fail fast: probed first, `http_settings` applied.

    Only settings the environment does not have are added, and they are removed at the end, so
    they hold for this job's calls and never leak into processes started later. A no-op for
    other stores (sqlite, file).
    """
    if not _is_http(uri):
        yield
        return
    probe(uri, cfg.timeout_s)
    added = {k: v for k, v in http_settings(cfg).items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def init_experiment(cfg: TrackingConfig, *, study: str, results_dir: str | Path) -> str:
    """Create the study's experiment if needed and return its id (raises on tracking errors).

    Call this once before parallel jobs start (a local rule): concurrent first writes to a fresh
    sqlite store race on schema migrations and on experiment creation.
    """
    uri = _prepare_store(cfg, results_dir)
    with connection(cfg, uri):
        from mlflow import MlflowClient

        return _experiment_id(MlflowClient(tracking_uri=uri), cfg, study, results_dir)


def ensure_experiment(cfg: TrackingConfig, *, study: str, results_dir: str | Path,
                      out: str | Path, log_file: str | Path | None = None) -> dict:
    """The DAG's `mlflow_experiment` rule: `init_experiment`, best effort.

    Writes `out` atomically: {"experiment", "experiment_id", "created", "tracking_uri", "error"}.
    With the store down (or broken) it still succeeds: `created` is false, `error` says why, a
    warning is logged, and training goes on; each job's Tracker creates the experiment if the
    store is back by then (`_experiment_id`, which survives the race). `log_file` gets the
    outcome line too. Returns what it wrote.
    """
    name = cfg.experiment or study
    uri = resolve_tracking_uri(cfg, results_dir)
    try:
        exp_id, error = init_experiment(cfg, study=study, results_dir=results_dir), None
        line = f"MLflow experiment {name!r} (id {exp_id}) is in {uri}"
        log.info(line)
    except Exception as e:  # the experiment is a convenience; training must start regardless
        exp_id, error = None, f"{type(e).__name__}: {e}"
        line = (f"WARNING: MLflow experiment {name!r} not created in {uri} ({error}); training "
                "goes on, its jobs create the experiment if the store is back, and "
                "metrics.jsonl keeps every metric")
        log.warning(line.removeprefix("WARNING: "))
    record = {"experiment": name, "experiment_id": exp_id, "created": exp_id is not None,
              "tracking_uri": uri, "error": error}
    atomic_write_json(out, record)
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(log_file, line + "\n")
    return record


def _prepare_store(cfg: TrackingConfig, results_dir: str | Path) -> str:
    # keep artifact uploads from drawing progress bars into SLURM logs
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if not cfg.tracking_uri:
        Path(results_dir).mkdir(parents=True, exist_ok=True)  # sqlite does not create folders
    return resolve_tracking_uri(cfg, results_dir)


# What the experiment is, for MLflow's UI and API (3.x): model training, not a GenAI app. The 3.17
# UI still opens on the traces overview until "Model training" is picked in its sidebar (or the
# URL has ?workflowType=machine_learning): docs/mlflow.md says so.
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}


def _experiment_id(client: Any, cfg: TrackingConfig, study: str, results_dir: str | Path) -> str:
    from mlflow.exceptions import MlflowException

    name = cfg.experiment or study
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if not set(EXPERIMENT_KIND) & set(exp.tags):  # made before the tag, or by someone else
            for k, v in EXPERIMENT_KIND.items():
                client.set_experiment_tag(exp.experiment_id, k, v)
        return exp.experiment_id
    location = cfg.artifact_location
    if location is None and not cfg.tracking_uri:
        # mlflow's default is ./mlruns under whatever cwd created the experiment
        location = (Path(results_dir).resolve() / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id  # another job won the race


def flatten(tree: Mapping[str, Any], sep: str, prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> one level, keys joined with `sep` ({"em": {"nq": 1}} -> {"em/nq": 1})."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten(value, sep, name))
        else:
            out[name] = value
    return out


def _number(value: Any) -> int | float:
    # ints stay ints in the jsonl (counts read better); numpy/torch scalars become floats
    return value if type(value) is int else float(value)


def _param_value(value: Any) -> str:
    # JSON spelling matches the YAML config (true, null, [1, 2]) rather than Python's repr
    return value if isinstance(value, str) else json.dumps(to_dict(value), default=str)


def _mlflow_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key)


Point = tuple[str, float, int, int]  # an MLflow metric point: (key, value, time ms, step)


def _points(values: Mapping[str, int | float | None], stamp: int, step: int) -> list[Point]:
    """The MLflow points of one step's values; non-finite values (null in the jsonl) stay out
    (MLflow would plot them as gaps or reject them, depending on the store)."""
    return [(_mlflow_key(k), float(v), stamp, step) for k, v in values.items()
            if v is not None and math.isfinite(v)]


def _row_points(row: Mapping[str, Any]) -> list[Point]:
    """The MLflow points of one metrics.jsonl row, as `Tracker.log` sends them."""
    values = {k: v for k, v in row.items() if k not in _ROW_KEYS}
    return _points(values, int(row["time"] * 1000), row["step"])


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


class Tracker:
    """Context manager that logs one job of one grid cell to metrics.jsonl and MLflow.

    Args:
        run_dir: the cell's directory; holds `mlflow_run.json`, the link to the cell's MLflow run.
        cfg: tracking settings.
        study: study name (the experiment name unless `cfg.experiment` is set).
        run_name: MLflow run name, the cell path (e.g. "toy/igpo/b0.3/g1.0/s0").
        tags: the cell's wildcards and anything to filter by (backbone, method, beta, gamma,
            seed, cell, stage, ...); values are stringified. SLURM_JOB_ID is added when set.
        params: the resolved config (mapping or dataclass); nested keys are joined with ".",
            matching the `a.b.c=value` override syntax.
        config_file: the resolved config file, attached to the run as an artifact.
        results_dir: root of the study's results; locates the default sqlite store.
        out_dir: where this job's metrics.jsonl, summary.json and tracker.json go (default
            run_dir); a job that adds to a cell another job wrote, like evaluation, uses a
            folder of its own.
    """

    def __init__(
        self,
        run_dir: str | Path,
        cfg: TrackingConfig,
        *,
        study: str,
        run_name: str,
        results_dir: str | Path,
        tags: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | Any = None,
        config_file: str | Path | None = None,
        out_dir: str | Path | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.out_dir = Path(out_dir) if out_dir is not None else self.run_dir
        self.cfg = cfg
        self.study = study
        self.run_name = run_name
        self.results_dir = Path(results_dir)
        self.tags = {k: str(v) for k, v in (tags or {}).items()}
        if dataclasses.is_dataclass(params):
            params = to_dict(params)
        self.params = {k: _param_value(v) for k, v in flatten(params or {}, ".").items()}
        self.config_file = Path(config_file) if config_file is not None else None
        self.run_id: str | None = None
        self._attached = False  # made by `attach`: logs into a run a previous job started
        self._artifacts: list[tuple[str, str | None]] = []  # log_artifact calls (path, under)
        self._inputs: list[dict] = []  # log_inputs' datasets (sync replays them)
        self._client: Any = None  # an MlflowClient while MLflow is on
        self._connection = contextlib.ExitStack()
        self._jsonl: Any = None
        self._pending: list[Point] = []
        self._since_flush = 0
        self._last_step = 0
        self._summary: dict[str, Any] = {}
        self._record: dict[str, Any] = {}
        self._monitor: Any = None  # mlflow's system-metrics monitor while it samples

    @classmethod
    def attach(
        cls,
        run_dir: str | Path,
        cfg: TrackingConfig,
        *,
        results_dir: str | Path,
        out_dir: str | Path,
        tags: Mapping[str, Any] | None = None,
    ) -> Tracker:
        """A Tracker that logs into the MLflow run a previous job of the cell started.

        Study and run name come from the cell's `mlflow_run.json`. Without that file (the earlier
        job ran with MLflow off or its tracking failed) the job logs to metrics.jsonl only, and
        `sync` attaches it once the cell's run is in MLflow.
        """
        link = _read_link(Path(run_dir))
        if link is None:
            if cfg.mlflow:
                log.warning("no %s in %s: this job logs to metrics.jsonl only (%s)",
                            RUN_LINK_FILE, run_dir, SYNC_HINT.format(run_dir))
            tracker = cls(run_dir, dataclasses.replace(cfg, mlflow=False), study="",
                          run_name="", results_dir=results_dir, tags=tags, out_dir=out_dir)
        else:
            # the run lives in the experiment it was created in, whatever the config says now
            cfg = dataclasses.replace(cfg, experiment=link["experiment"])
            tracker = cls(run_dir, cfg, study=link["experiment"], run_name=link["run_name"],
                          results_dir=results_dir, tags=tags, out_dir=out_dir)
        tracker._attached = True
        return tracker

    @property
    def mlflow_enabled(self) -> bool:
        """Whether MLflow is still being written (false after a tracking failure)."""
        return self._client is not None

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Tracker:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / METRICS_FILE
        cut_unfinished_line(path)
        self._jsonl = open(path, "a")
        if "SLURM_JOB_ID" in os.environ:
            self.tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        self._start_record()
        if self.cfg.mlflow:
            self._guarded("starting the MLflow run", self._start_mlflow)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, Exception):
            status = "FAILED"
        else:  # KeyboardInterrupt, SystemExit: stopped (e.g. preempted), not broken
            status = "KILLED"
        try:
            if self._monitor is not None:
                self._stop_system_metrics()
            if self._client is not None:
                self._guarded("flushing metrics", self._flush)
            if self._client is not None:
                self._guarded("ending the MLflow run",
                              lambda: self._client.set_terminated(self.run_id, status))
            self._write_record(status=status, ended=round(time.time(), 3))
        finally:
            self._jsonl.close()
            self._connection.close()
        return False  # never swallow the job's exception

    def _start_mlflow(self) -> None:
        uri = _prepare_store(self.cfg, self.results_dir)
        # probe first: a dead server is found in timeout_s, before the second `import mlflow`
        self._connection.enter_context(connection(self.cfg, uri))
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        run, created = self._open_run(client, uri)
        if not created:
            client.update_run(run.info.run_id, status="RUNNING")
            log.info("resuming MLflow run %s (%s)", run.info.run_id, run.info.status)
        self._client, self.run_id = client, run.info.run_id
        self._log_tags(self.tags)
        self._log_params({} if created else run.data.params)
        if self.config_file is not None:
            client.log_artifact(self.run_id, str(self.config_file))
        if self.cfg.system_metrics:
            self._start_system_metrics(uri)

    def _open_run(self, client: Any, uri: str, start_time: int | None = None) -> tuple[Any, bool]:
        """(the cell's run, whether it was created now): the linked run, or a new one."""
        from mlflow.exceptions import MlflowException

        link = _read_link(self.run_dir)
        if link is not None:
            run = None
            try:
                run = client.get_run(link["run_id"])
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            if run is not None and run.info.lifecycle_stage != "deleted":
                return run, False
            log.warning("MLflow run %s of %s is not in %s; starting a new run",
                        link["run_id"], self.run_dir, uri)
        experiment_id = _experiment_id(client, self.cfg, self.study, self.results_dir)
        run = client.create_run(experiment_id, run_name=self.run_name, start_time=start_time)
        atomic_write_json(self.run_dir / RUN_LINK_FILE, {
            "run_id": run.info.run_id,
            "experiment_id": experiment_id,
            "experiment": self.cfg.experiment or self.study,
            "run_name": self.run_name,
            "tracking_uri": uri,
        })
        return run, True

    def _guarded(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # whatever tracking raises, training goes on
            log.warning("MLflow tracking off for the rest of this job (%s failed: %s: %s); "
                        "metrics still go to %s; %s", what, type(e).__name__, e,
                        self.out_dir / METRICS_FILE, SYNC_HINT.format(self.run_dir))
            self._client = None
            self._pending.clear()

    # ---- system metrics -------------------------------------------------------------------

    def _start_system_metrics(self, uri: str) -> None:
        """Start mlflow's system-metrics monitor on this job's run: a daemon thread that samples
        every `system_metrics_interval_s` and logs system/... points with its own client. It
        stops by itself when the run is no longer RUNNING. A monitor that cannot start (psutil
        missing, ...) costs a warning; the rest of MLflow goes on."""
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            # its start and stop are three INFO lines in every job's log; our line says it all
            logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
            # resume_logging: a resumed or attached job's points follow the run's last ones
            monitor = SystemMetricsMonitor(
                self.run_id, sampling_interval=self.cfg.system_metrics_interval_s,
                resume_logging=True, tracking_uri=uri)
            monitor.start()
        except Exception as e:
            log.warning("no system metrics for MLflow run %s (%s: %s); the other metrics go on",
                        self.run_id, type(e).__name__, e)
            return
        self._monitor = monitor
        gpu = any(type(m).__name__ in ("GPUMonitor", "ROCMMonitor") for m in monitor.monitors)
        log.info("system metrics every %g s into MLflow run %s (CPU, memory, disk, network; %s)",
                 monitor.sampling_interval, self.run_id,
                 "GPU through NVML" if gpu else "no GPU: none found, or no nvidia-ml-py")

    def _stop_system_metrics(self) -> None:
        """Stop the monitor and log its last window: mlflow's thread drops the samples of a
        window the stop cuts short, so a job shorter than one interval would have none."""
        monitor, self._monitor = self._monitor, None
        try:
            monitor.finish()  # wakes the thread, joins it, flushes what it buffered
            if self._client is not None:  # MLflow still answers
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
                monitor.mlflow_logger.flush()
        except Exception as e:  # the job's own metrics and status still go out
            log.warning("the last system metrics of MLflow run %s were not logged (%s: %s)",
                        self.run_id, type(e).__name__, e)

    # ---- the record sync replays ----------------------------------------------------------

    def _start_record(self) -> None:
        """tracker.json: what this job logs besides its metrics, merged with what earlier jobs
        in out_dir logged (a resumed job, or a sweep's run created before its training): tags
        by the newest value, params by the first, as MLflow keeps them."""
        try:
            old = _read_record(self.out_dir) or {}
        except ValueError as e:  # a side file of tracking must not stop the job
            aside = self.out_dir / (RECORD_FILE + ".damaged")
            os.replace(self.out_dir / RECORD_FILE, aside)
            log.warning("%s; moved to %s: this job starts a new record, so `sync` will not "
                        "replay the earlier jobs' tags, params and artifacts", e, aside)
            old = {}
        here = self.out_dir.resolve()
        config = self.config_file and os.path.relpath(self.config_file.resolve(), here)
        self._record = {
            "study": self.study,
            "run_name": self.run_name,
            "attach": self._attached,
            "run_dir": os.path.relpath(self.run_dir.resolve(), here),
            "results_dir": os.path.relpath(self.results_dir.resolve(), here),
            "tracking": to_dict(self.cfg),
            "tags": {**old.get("tags", {}), **self.tags},
            "params": {**self.params, **old.get("params", {})},
            "config_file": config or old.get("config_file"),
            "artifacts": old.get("artifacts", []),
            "inputs": old.get("inputs", []),
            "started": old.get("started", round(time.time(), 3)),
            "ended": None,
            "status": None,  # null while the job runs, or when it was killed
        }
        self._write_record()

    def _write_record(self, **changes: Any) -> None:
        self._record.update(changes)
        try:
            atomic_write_json(self.out_dir / RECORD_FILE, self._record)
        except OSError as e:  # the record serves a later sync; the job does not need it
            log.warning("could not write %s (%s); `sync` will not know this job",
                        self.out_dir / RECORD_FILE, e)

    # ---- logging --------------------------------------------------------------------------

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step: a line of metrics.jsonl now, MLflow every `cfg.log_every` calls.

        Nested mappings are flattened with "/". Non-finite values are written as null and
        skipped in MLflow (it would plot them as gaps or reject them, depending on the store).
        """
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for key, value in flatten(metrics, "/").items():
            if key in row:
                raise ValueError(f"metric name {key!r} is reserved in {METRICS_FILE}")
            value = _number(value)
            row[key] = value if math.isfinite(value) else None
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()  # the OS keeps the line if the process is killed
        self._last_step = step
        self._since_flush += 1
        if self._client is None:
            return
        self._pending.extend(_row_points(row))
        if self._since_flush >= self.cfg.log_every:
            self._guarded("logging metrics", self._flush)

    def _flush(self) -> None:
        from mlflow.entities import Metric
        from mlflow.utils.validation import MAX_METRICS_PER_BATCH

        metrics = [Metric(k, v, t, s) for k, v, t, s in self._pending]
        for chunk in _chunks(metrics, MAX_METRICS_PER_BATCH):
            self._client.log_batch(self.run_id, metrics=chunk)
        self._pending.clear()
        self._since_flush = 0

    def summary(self, metrics: Mapping[str, Any]) -> None:
        """Record final metrics in `<out_dir>/summary.json` and as MLflow metrics.

        The file merges every `summary` call of this job and is written atomically; in MLflow
        the values are logged at the last logged step.
        """
        flat = {k: _number(v) for k, v in flatten(metrics, "/").items()}
        self._summary.update({k: v if math.isfinite(v) else None for k, v in flat.items()})
        atomic_write_json(self.out_dir / SUMMARY_FILE, self._summary)
        if self._client is None:
            return
        self._pending.extend(_points(flat, int(time.time() * 1000), self._last_step))
        self._guarded("logging the summary", self._flush)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set (or overwrite) run tags, e.g. the selected checkpoint's path."""
        tags = {k: str(v) for k, v in tags.items()}
        self.tags.update(tags)
        self._write_record(tags={**self._record["tags"], **tags})
        if self._client is not None:
            self._guarded("setting tags", lambda: self._log_tags(tags))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Attach a file (or a folder's files) to the run, under `artifact_path` if given."""
        entry = [str(Path(path).resolve()), artifact_path]
        if entry not in self._record["artifacts"]:
            self._write_record(artifacts=[*self._record["artifacts"], entry])
        if self._client is not None:
            self._guarded(f"logging artifact {path}", lambda: self._client.log_artifact(
                self.run_id, str(path), artifact_path))

    def log_inputs(self, datasets: Iterable[Mapping[str, Any]]) -> None:
        """Log the datasets a job read as the run's MLflow dataset inputs.

        Each is a dict of DATASET_KEYS: name, digest (at most 36 characters), source_type and
        source (JSON) as MLflow's dataset sources spell them, profile (JSON or None) and context
        (training, validation, test: the Dataset column shows it). MLflow keeps one input per
        (name, digest) in a run, so logging one again adds nothing.
        """
        datasets = [_dataset(d) for d in datasets]
        known = {(d["name"], d["digest"]) for d in self._record["inputs"]}
        new = [d for d in datasets if (d["name"], d["digest"]) not in known]
        if new:
            self._write_record(inputs=[*self._record["inputs"], *new])
        if self._client is not None and datasets:
            self._guarded("logging dataset inputs", lambda: self._log_inputs(datasets))

    def _log_inputs(self, datasets: list[dict]) -> None:
        from mlflow.entities import Dataset, DatasetInput, InputTag

        self._client.log_inputs(self.run_id, [
            DatasetInput(Dataset(d["name"], d["digest"], d["source_type"], d["source"],
                                 profile=d["profile"]),
                         [InputTag(_DATASET_CONTEXT, d["context"])]) for d in datasets])

    def _log_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VAL_LENGTH

        entities = [RunTag(k, v[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()]
        for chunk in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=chunk)

    def _log_params(self, logged: Mapping[str, str]) -> int:
        """Log the params the run does not have yet; returns how many."""
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {_mlflow_key(k): v[:MAX_PARAM_VAL_LENGTH] for k, v in self.params.items()}
        # params are immutable in MLflow: a resumed run keeps its first values, and re-sending
        # a changed one would fail the whole batch
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("config changed since MLflow run %s started; it keeps the first values "
                        "of %s", self.run_id, ", ".join(changed))
        entities = [Param(k, v) for k, v in params.items() if k not in logged]
        for chunk in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)
        return len(entities)

    # ---- sync -----------------------------------------------------------------------------

    def _sync(self, record: Mapping[str, Any]) -> SyncedRun:
        """Log into the cell's MLflow run what this job's files hold and the run lacks.

        Creates (and links) the run if there is none. Metric points are compared by (key,
        step), so points already there are never sent twice; within metrics.jsonl the later row
        of a step wins, as in `read_metrics`. Tags are added where the run lacks them (an
        attached job, like evaluation, overwrites them, as it would have live); params only
        where missing (MLflow keeps the first); the status is set where the run still says
        RUNNING (an attached job: where it differs), and only if the job ended.
        """
        from mlflow import MlflowClient

        uri = _prepare_store(self.cfg, self.results_dir)
        with connection(self.cfg, uri):
            client = MlflowClient(tracking_uri=uri)
            run, created = self._open_run(client, uri, start_time=_ms(record.get("started")))
            self._client, self.run_id = client, run.info.run_id
            try:
                return self._sync_into(run, created, record)
            finally:
                self._client = None

    def _sync_into(self, run: Any, created: bool, record: Mapping[str, Any]) -> SyncedRun:
        client, attached = self._client, self._attached
        have = run.data.tags
        tags = {k: v for k, v in self.tags.items()
                if have.get(k) != v and (attached or k not in have)}
        if tags:
            self._log_tags(tags)
        params = self._log_params(run.data.params)
        artifacts = 0
        files = [(str(self.config_file), None)] if self.config_file is not None else []
        for path, under in files + [tuple(a) for a in self._artifacts]:
            if Path(path).exists() and not _has_artifact(client, self.run_id, path, under):
                client.log_artifact(self.run_id, path, under)
                artifacts += 1
        there_inputs = {(i.dataset.name, i.dataset.digest)
                        for i in (run.inputs.dataset_inputs if run.inputs else [])}
        inputs = [d for d in self._inputs if (d["name"], d["digest"]) not in there_inputs]
        if inputs:
            self._log_inputs(inputs)

        points = self._job_points()
        there: dict[str, set[int]] = {}
        if not created:
            for key in sorted({k for k, _ in points}):
                there[key] = {m.step for m in client.get_metric_history(self.run_id, key)}
        self._pending = [p for (k, s), p in points.items() if s not in there.get(k, ())]
        uploaded = len(self._pending)
        self._flush()

        status, ended = record.get("status"), _ms(record.get("ended"))
        set_status = bool(status) and run.info.status != status and (
            attached or run.info.status == "RUNNING")
        if set_status:
            client.set_terminated(self.run_id, status, end_time=ended)
        changed = created or bool(tags or params or artifacts or inputs or uploaded) or set_status
        return SyncedRun(self.out_dir, self.run_id, created=created, changed=changed,
                         points=uploaded, present=len(points) - uploaded)

    def _job_points(self) -> dict[tuple[str, int], Point]:
        """This job's MLflow points by (key, step), from metrics.jsonl and summary.json as
        `log` and `summary` would have sent them (the later one of a (key, step) wins)."""
        points: dict[tuple[str, int], Point] = {}
        rows = read_metrics(self.out_dir) if (self.out_dir / METRICS_FILE).exists() else []
        for row in rows:
            for p in _row_points(row):
                points[p[0], p[3]] = p
        summary_file = self.out_dir / SUMMARY_FILE
        if summary_file.exists():
            summary = json.loads(summary_file.read_text())
            stamp = int(summary_file.stat().st_mtime * 1000)
            for p in _points(summary, stamp, rows[-1]["step"] if rows else 0):
                points[p[0], p[3]] = p
        return points


# ---- sync: what MLflow missed, from the jobs' files -----------------------------------------


@dataclass
class SyncedRun:
    """One job's folder after `sync`: its run, whether anything was sent, and how many points."""

    out_dir: Path
    run_id: str
    created: bool  # the run did not exist in the store
    changed: bool  # anything was logged (false: the run already had all of it)
    points: int  # metric points uploaded
    present: int  # metric points the run already had


@dataclass
class SyncReport:
    """What `sync` did: the runs it visited, and the folders it skipped or failed on (why)."""

    runs: list[SyncedRun] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)

    def format(self) -> str:
        lines = []
        for r in self.runs:
            state = "created" if r.created else "updated" if r.changed else "complete"
            lines.append(f"{state:8} {r.out_dir} -> run {r.run_id}: {r.points} points "
                         f"uploaded, {r.present} already there")
        lines += [f"skipped  {folder}: {why}" for folder, why in self.skipped]
        lines += [f"FAILED   {folder}: {why}" for folder, why in self.failed]
        synced = [r for r in self.runs if r.changed]
        lines.append(
            f"{len(synced)} jobs synced into {len({r.run_id for r in synced})} runs "
            f"({sum(r.created for r in synced)} created), "
            f"{sum(r.points for r in self.runs)} points uploaded, "
            f"{sum(r.present for r in self.runs)} already there; "
            f"{len(self.runs) - len(synced)} complete, {len(self.skipped)} skipped, "
            f"{len(self.failed)} failed")
        return "\n".join(lines)


def sync(paths: Iterable[str | Path], *, tracking_uri: str | None = None,
         experiment: str | None = None) -> SyncReport:
    """Upload to MLflow what the jobs under `paths` logged only to their files.

    `paths` are results folders or job folders; every folder below with a tracker.json is a
    job (a cell's training, its evaluation's `eval/tracking`, a sweep trial's run). Each is
    replayed into its run as its Tracker would have logged it (`Tracker._sync`), into the store
    and experiment its config named unless `tracking_uri` / `experiment` say otherwise; a
    cell's own jobs go before the jobs attached to it. Idempotent: a second call sends nothing.
    (A job still running with MLflow on may later flush points sync already sent: the same
    key, step and value twice, which MLflow draws as the same curve.) A store that does not
    answer raises TrackingUnreachable; a job that fails is reported and the rest go on.
    """
    report = SyncReport()
    jobs, unrecorded, damaged = _find_jobs(paths)
    why = f"{METRICS_FILE} without {RECORD_FILE} (its job kept no record of its tags and params)"
    report.skipped += [(folder, why) for folder in unrecorded]
    report.failed += damaged
    for folder, record in jobs:
        try:
            tracker = _replay(folder, record, tracking_uri, experiment)
            if tracker is None:
                why = f"its cell {folder / record['run_dir']} has no MLflow run (sync it first)"
                report.skipped.append((folder, why))
                continue
            report.runs.append(tracker._sync(record))
        except TrackingUnreachable:
            raise
        except Exception as e:  # one broken folder does not stop the others
            report.failed.append((folder, f"{type(e).__name__}: {e}"))
    return report


def _find_jobs(paths: Iterable[str | Path]) -> tuple[list[tuple[Path, dict]], list[Path],
                                                     list[tuple[Path, str]]]:
    """([(job folder, its record)] with attached jobs last, [folders with metrics only],
    [(job folder, why its record cannot be read)])."""
    folders: dict[Path, Path] = {}
    unrecorded: dict[Path, Path] = {}
    for path in map(Path, paths):
        if not path.is_dir():
            raise FileNotFoundError(f"{path}: no such folder")
        for f in sorted(path.rglob(RECORD_FILE)):
            folders.setdefault(f.parent.resolve(), f.parent)
        for f in sorted(path.rglob(METRICS_FILE)):
            if not (f.parent / RECORD_FILE).exists():
                unrecorded.setdefault(f.parent.resolve(), f.parent)
    jobs, damaged = [], []
    for folder in folders.values():
        try:
            jobs.append((folder, _read_record(folder)))
        except (OSError, ValueError) as e:  # one damaged record does not stop the others
            damaged.append((folder, str(e)))
    jobs.sort(key=lambda job: bool(job[1]["attach"]))  # stable: paths order otherwise
    return jobs, list(unrecorded.values()), damaged


def _replay(folder: Path, record: Mapping[str, Any], tracking_uri: str | None,
            experiment: str | None) -> Tracker | None:
    """The Tracker the job in `folder` ran, rebuilt from its record (None: an attached job
    whose cell has no run yet)."""
    cfg = from_dict(TrackingConfig, record["tracking"], source=str(folder / RECORD_FILE),
                    path="tracking")
    cfg = dataclasses.replace(cfg, mlflow=True, tracking_uri=tracking_uri or cfg.tracking_uri,
                              experiment=experiment or cfg.experiment)
    run_dir = (folder / record["run_dir"]).resolve()
    results_dir = (folder / record["results_dir"]).resolve()
    if record["attach"]:
        if _read_link(run_dir) is None:
            return None
        tracker = Tracker.attach(run_dir, cfg, results_dir=results_dir, out_dir=folder,
                                 tags=record["tags"])
    else:
        config = record["config_file"]
        tracker = Tracker(run_dir, cfg, study=record["study"], run_name=record["run_name"],
                          results_dir=results_dir, tags=record["tags"], params=record["params"],
                          config_file=folder / config if config else None, out_dir=folder)
    tracker._artifacts = [(path, under) for path, under in record["artifacts"]]
    tracker._inputs = [_dataset(d) for d in record.get("inputs", [])]  # older records: none
    return tracker


def _has_artifact(client: Any, run_id: str, path: str, under: str | None) -> bool:
    """Whether the run has `path` where log_artifact puts it (under its own name); a file
    whose size differs is one the job rewrote since (a study's tables), so it counts as
    missing."""
    local = Path(path)
    for a in client.list_artifacts(run_id, under):
        if Path(a.path).name == local.name:
            return a.is_dir or not local.is_file() or a.file_size == local.stat().st_size
    return False


def _dataset(d: Mapping[str, Any]) -> dict:
    """A dataset input as `log_inputs` takes it; ValueError naming what is missing."""
    missing = [k for k in DATASET_KEYS if k not in d]
    if missing:
        raise ValueError(f"dataset input {d.get('name')!r}: no {', '.join(missing)}")
    if len(d["digest"]) > 36:  # MLflow's limit (mlflow.utils.validation)
        raise ValueError(f"dataset input {d['name']!r}: digest longer than 36 characters")
    return {k: d[k] for k in DATASET_KEYS}


def _read_link(run_dir: Path) -> dict | None:
    path = run_dir / RUN_LINK_FILE
    return json.loads(path.read_text()) if path.exists() else None


# what `_replay` reads from a record (the Tracker writes them all)
_RECORD_KEYS = ("study", "run_name", "attach", "run_dir", "results_dir", "tracking", "tags",
                "params", "config_file", "artifacts")


def _read_record(folder: Path) -> dict | None:
    """`folder`'s tracker.json (None: there is none); ValueError naming the file when it is
    damaged (not JSON, or not a record the Tracker writes)."""
    path = folder / RECORD_FILE
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_bytes())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{path}: damaged: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: damaged: a JSON {type(record).__name__}, not an object")
    missing = [k for k in _RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"{path}: damaged: no {', '.join(missing)}")
    return record


def cut_after(path: str | Path, step: int | None) -> int:
    """Drop the rows of a JSON-lines step log (metrics.jsonl, rollouts.jsonl) logged for steps
    after `step` (every row when None), atomically (a new file renamed over the old one), and
    an unfinished last line (a killed writer's; its bytes go to `<path>.partial`). A rerun
    resumes from step `step`'s checkpoint and logs the later steps again; their first rows,
    from the job that went past the checkpoint, would be a second record of them. Returns the
    number of rows dropped; no file is nothing to do.

    MLflow's record cannot be cut this way (a run's metric points are append-only): there a
    step the rerun repeats keeps both points."""
    path = Path(path)
    if not path.exists():
        return 0
    dropped = int(cut_unfinished_line(path) > 0)  # a killed writer's last line
    rows = list(iter_jsonl(path))
    for lineno, row in rows:
        if "step" not in row:
            raise ValueError(f"{path}:{lineno}: a row without \"step\"")
    keep = [n for n, row in rows if step is not None and row["step"] <= step]
    if len(keep) < len(rows):
        lines = path.read_bytes().split(b"\n")
        atomic_write_text(path, "".join(lines[n - 1].decode() + "\n" for n in keep))
        dropped += len(rows) - len(keep)
    if dropped:
        log.info("%s: dropped %d row(s) after %s (the resumed run logs them again)", path,
                 dropped, "the start" if step is None else f"step {step}")
    return dropped


def read_metrics(run_dir: str | Path, name: str = METRICS_FILE) -> list[dict]:
    """The rows of `<run_dir>/metrics.jsonl`, in the order they were logged.

    An unfinished last line (a writer killed mid-line, or one still writing) is skipped with a
    warning naming the file and line; a bad line anywhere else is damage and raises
    `a2tgpo.io.JsonLinesError` (a ValueError) naming the file and line. A resumed training
    job first cuts the rows after its checkpoint (`cut_after`), so a step appears once, or
    twice where the resumed job finished a validation the stop cut short (a row of its own).
    """
    return [row for _, row in iter_jsonl(Path(run_dir) / name)]
