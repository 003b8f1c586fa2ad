"""One logger for training, evaluation and sweeps: `metrics.jsonl` plus an MLflow run.

Every job writes `<out_dir>/metrics.jsonl` (one JSON object per `log` call, flushed at once, so a
killed job keeps what it logged); Snakemake rules, Optuna objectives and tests read only that file
(`read_metrics`). MLflow is the browsing layer on top: one experiment per study, one run per grid
cell, with the cell's wildcards as tags, the flattened resolved config as params and the resolved
config file as an artifact (DESIGN §3 "Tracking").

One cell, one run. The run id is kept in `<run_dir>/mlflow_run.json`, so a rerun of the cell
(resume after preemption, or after a kill left the run RUNNING) and the evaluation job
(`Tracker.attach`) log into the same run and the UI shows the whole cell in one row.

Tracking never stops training. Every MLflow call is guarded: the first failure (server down,
sqlite locked, mlflow not importable, ...) is logged once as a warning with its reason, MLflow is
switched off for the rest of the job, and metrics.jsonl keeps going.

Run status: leaving the `with` block normally ends the run FINISHED; an `Exception` ends it FAILED
and a `KeyboardInterrupt`/`SystemExit` (SIGINT, or a SIGTERM handler that exits) ends it KILLED,
and the exception propagates. SIGKILL (and SIGTERM without a handler) cannot be caught: the run
stays RUNNING until the cell's next start resumes it by id and closes it properly.

With a server URI, mlflow retries each failed HTTP request with exponential backoff
(MLFLOW_HTTP_REQUEST_MAX_RETRIES, default 7: about 4 minutes) before the failure reaches us;
lower it where a down server should be noticed sooner.

`import mlflow` takes about a second, so it happens only when a Tracker starts with MLflow on.
A Tracker is not thread-safe; log from one thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from a2tgpo.config import option, to_dict
from a2tgpo.io import atomic_write_json

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RUN_LINK_FILE = "mlflow_run.json"

# characters MLflow accepts in metric and param names (mlflow.utils.validation); anything else
# would make the whole batch fail, so it becomes "_" in MLflow (metrics.jsonl keeps the original)
_BAD_KEY_CHARS = re.compile(r"[^/\w.\- :]")


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
        "metrics.jsonl gets every step immediately.",
    )

    def __post_init__(self) -> None:
        if self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {self.log_every}")


def resolve_tracking_uri(cfg: TrackingConfig, results_dir: str | Path) -> str:
    """The tracking URI a job uses: `cfg.tracking_uri`, or the sqlite file under results_dir."""
    if cfg.tracking_uri:
        return cfg.tracking_uri
    # an absolute path gives four slashes, so the URI does not depend on the job's cwd
    return f"sqlite:///{Path(results_dir).resolve() / 'mlflow.db'}"


def init_experiment(cfg: TrackingConfig, *, study: str, results_dir: str | Path) -> str:
    """Create the study's experiment if needed and return its id (raises on tracking errors).

    Call this once before parallel jobs start (a local rule): concurrent first writes to a fresh
    sqlite store race on schema migrations and on experiment creation.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=_prepare_store(cfg, results_dir))
    return _experiment_id(client, cfg, study, results_dir)


def _prepare_store(cfg: TrackingConfig, results_dir: str | Path) -> str:
    # keep artifact uploads from drawing progress bars into SLURM logs
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if not cfg.tracking_uri:
        Path(results_dir).mkdir(parents=True, exist_ok=True)  # sqlite does not create folders
    return resolve_tracking_uri(cfg, results_dir)


def _experiment_id(client: Any, cfg: TrackingConfig, study: str, results_dir: str | Path) -> str:
    from mlflow.exceptions import MlflowException

    name = cfg.experiment or study
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = cfg.artifact_location
    if location is None and not cfg.tracking_uri:
        # mlflow's default is ./mlruns under whatever cwd created the experiment
        location = (Path(results_dir).resolve() / "mlartifacts").as_uri()
    try:
        return client.create_experiment(name, artifact_location=location)
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


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


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
        out_dir: where this job's metrics.jsonl and summary.json go (default run_dir); a job
            that adds to a cell another job wrote, like evaluation, uses a folder of its own.
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
        self.tags = dict(tags or {})
        if dataclasses.is_dataclass(params):
            params = to_dict(params)
        self.params = flatten(params or {}, ".")
        self.config_file = Path(config_file) if config_file is not None else None
        self.run_id: str | None = None
        self._client: Any = None  # an MlflowClient while MLflow is on
        self._jsonl: Any = None
        self._pending: list[tuple[str, float, int, int]] = []  # (key, value, time ms, step)
        self._since_flush = 0
        self._last_step = 0
        self._summary: dict[str, Any] = {}

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
        job ran with MLflow off or its tracking failed) the job logs to metrics.jsonl only.
        """
        link = _read_link(Path(run_dir))
        if link is None:
            if cfg.mlflow:
                log.warning("no %s in %s: this job logs to metrics.jsonl only",
                            RUN_LINK_FILE, run_dir)
            return cls(run_dir, dataclasses.replace(cfg, mlflow=False), study="", run_name="",
                       results_dir=results_dir, tags=tags, out_dir=out_dir)
        # the run lives in the experiment it was created in, whatever the config says now
        cfg = dataclasses.replace(cfg, experiment=link["experiment"])
        return cls(run_dir, cfg, study=link["experiment"], run_name=link["run_name"],
                   results_dir=results_dir, tags=tags, out_dir=out_dir)

    @property
    def mlflow_enabled(self) -> bool:
        """Whether MLflow is still being written (false after a tracking failure)."""
        return self._client is not None

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Tracker:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / METRICS_FILE
        _drop_partial_line(path)
        self._jsonl = open(path, "a")
        if self.cfg.mlflow:
            self._guarded("starting the MLflow run", self._start_mlflow)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            if self._client is not None:
                self._guarded("flushing metrics", self._flush)
            if self._client is not None:
                if exc_type is None:
                    status = "FINISHED"
                elif issubclass(exc_type, Exception):
                    status = "FAILED"
                else:  # KeyboardInterrupt, SystemExit: stopped (e.g. preempted), not broken
                    status = "KILLED"
                self._guarded("ending the MLflow run",
                              lambda: self._client.set_terminated(self.run_id, status))
        finally:
            self._jsonl.close()
        return False  # never swallow the job's exception

    def _start_mlflow(self) -> None:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        uri = _prepare_store(self.cfg, self.results_dir)
        client = MlflowClient(tracking_uri=uri)
        link = _read_link(self.run_dir)
        run = None
        if link is not None:
            try:
                run = client.get_run(link["run_id"])
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
            if run is None or run.info.lifecycle_stage == "deleted":
                log.warning("MLflow run %s of %s is not in %s; starting a new run",
                            link["run_id"], self.run_dir, uri)
                run = None
        if run is not None:
            client.update_run(run.info.run_id, status="RUNNING")
            log.info("resuming MLflow run %s (%s)", run.info.run_id, run.info.status)
            logged = run.data.params
        else:
            experiment_id = _experiment_id(client, self.cfg, self.study, self.results_dir)
            run = client.create_run(experiment_id, run_name=self.run_name)
            atomic_write_json(self.run_dir / RUN_LINK_FILE, {
                "run_id": run.info.run_id,
                "experiment_id": experiment_id,
                "experiment": self.cfg.experiment or self.study,
                "run_name": self.run_name,
                "tracking_uri": uri,
            })
            logged = {}
        self._client, self.run_id = client, run.info.run_id

        tags = dict(self.tags)
        if "SLURM_JOB_ID" in os.environ:
            tags["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        self._log_tags(tags)
        self._log_params(logged)
        if self.config_file is not None:
            client.log_artifact(self.run_id, str(self.config_file))

    def _guarded(self, what: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # whatever tracking raises, training goes on
            log.warning("MLflow tracking off for the rest of this job (%s failed: %s: %s); "
                        "metrics still go to %s", what, type(e).__name__, e,
                        self.out_dir / METRICS_FILE)
            self._client = None
            self._pending.clear()

    # ---- logging --------------------------------------------------------------------------

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log one step: a line of metrics.jsonl now, MLflow every `cfg.log_every` calls.

        Nested mappings are flattened with "/". Non-finite values are written as null and
        skipped in MLflow (it would plot them as gaps or reject them, depending on the store).
        """
        row: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        stamp = int(row["time"] * 1000)
        for key, value in flatten(metrics, "/").items():
            if key in row:
                raise ValueError(f"metric name {key!r} is reserved in {METRICS_FILE}")
            value = _number(value)
            finite = math.isfinite(value)
            row[key] = value if finite else None
            if self._client is None:
                continue
            if finite:
                self._pending.append((_mlflow_key(key), float(value), stamp, step))
            else:
                log.debug("step %d: %s = %s not sent to MLflow", step, key, value)
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()  # the OS keeps the line if the process is killed
        self._last_step = step
        self._since_flush += 1
        if self._client is not None and self._since_flush >= self.cfg.log_every:
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
        stamp = int(time.time() * 1000)
        self._pending.extend((_mlflow_key(k), float(v), stamp, self._last_step)
                             for k, v in flat.items() if math.isfinite(v))
        self._guarded("logging the summary", self._flush)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set (or overwrite) run tags, e.g. the selected checkpoint's path."""
        if self._client is not None:
            self._guarded("setting tags", lambda: self._log_tags(tags))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Attach a file (or a folder's files) to the run, under `artifact_path` if given."""
        if self._client is not None:
            self._guarded(f"logging artifact {path}", lambda: self._client.log_artifact(
                self.run_id, str(path), artifact_path))

    def _log_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag
        from mlflow.utils.validation import MAX_PARAMS_TAGS_PER_BATCH, MAX_TAG_VAL_LENGTH

        entities = [RunTag(k, str(v)[:MAX_TAG_VAL_LENGTH]) for k, v in tags.items()]
        for chunk in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, tags=chunk)

    def _log_params(self, logged: Mapping[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        params = {_mlflow_key(k): _param_value(v)[:MAX_PARAM_VAL_LENGTH]
                  for k, v in self.params.items()}
        # params are immutable in MLflow: a resumed run keeps its first values, and re-sending
        # a changed one would fail the whole batch
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        if changed:
            log.warning("config changed since MLflow run %s started; it keeps the first values "
                        "of %s", self.run_id, ", ".join(changed))
        entities = [Param(k, v) for k, v in params.items() if k not in logged]
        for chunk in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._client.log_batch(self.run_id, params=chunk)


def _read_link(run_dir: Path) -> dict | None:
    path = run_dir / RUN_LINK_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _drop_partial_line(path: Path) -> None:
    """Cut a last line a killed writer left without its newline, so appends start clean."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            log.warning("%s: dropping a truncated last line (%d bytes)", path, len(data) - keep)
            f.truncate(keep)


def read_metrics(run_dir: str | Path, name: str = METRICS_FILE) -> list[dict]:
    """The rows of `<run_dir>/metrics.jsonl`, in the order they were logged.

    A truncated last line (a writer killed mid-line, or one still writing) is ignored with a
    warning; a bad line anywhere else is corruption and raises ValueError. After a resume, steps
    between the last checkpoint and the kill appear twice; the later row is the resumed job's.
    """
    path = Path(run_dir) / name
    lines = path.read_text().split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # no newline after it: the writer never finished it
                log.warning("%s: ignoring a truncated last line", path)
                break
            raise ValueError(f"{path}:{i + 1}: not valid JSON: {e}") from e
    return rows
