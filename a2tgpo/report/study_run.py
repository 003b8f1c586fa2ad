"""The study's own MLflow run: its tables and plots, beside the cells' runs.

One run per study, named `study · <study>`, and one per extra grid set, `study · <study> · set
<name>` (a2tgpo.tracking.study_run_name), tagged kind=study (and set=<name>), so searching
`tags.kind = 'study'` finds them. The report rules (workflow/rules/report.smk) log their outputs
into it each time they run (`a2tgpo tables|plots ... --study-run [--set NAME]`): tables/<table>.
{md,tex,csv} and plots/<backbone>/<kind>.png with plots/index.json; a file written again
replaces the one at the same artifact path. Every cell's training run names its study run in
its `study_run` tag (a2tgpo/train/rl.py): by name, which is known before the study run exists,
where an id would not be.

It is a Tracker like a cell's (a2tgpo.tracking): the folder `<results>/mlflow/study` (a set's:
`<results>/mlflow/sets/<name>`) holds the link to the run (mlflow_run.json), and each rule logs
from a subfolder of its own (tables/, plots/) that keeps its tracker.json, so `a2tgpo
sync-mlflow <results>` creates and fills a study run the store missed. The tables and plots
rules may run at once: a lock on the folder keeps them from creating two runs.

The store and experiment are those of the cells: the tracking section of the first cell's
config.yaml. Best effort, as all tracking: a failure is a warning; the files are written.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from a2tgpo.config import from_dict, read_yaml
from a2tgpo.tracking import (
    KIND_TAG,
    STUDY_KIND,
    STUDY_RUN_TAG,
    Tracker,
    TrackingConfig,
    study_run_name,
)

log = logging.getLogger(__name__)

FOLDER = "mlflow"  # under the study's results folder, beside experiment.json


def study_run_dir(results_dir: str | Path, grid_set: str | None = None) -> Path:
    """The folder that links a study run (of one extra grid set, if given)."""
    base = Path(results_dir) / FOLDER
    return base / "study" if grid_set is None else base / "sets" / grid_set


def log_outputs(cell_dirs: Sequence[Path], out: str | Path, what: str,
                grid_set: str | None = None) -> str | None:
    """Log the files `a2tgpo tables|plots` wrote into `out` into the study run as
    `<what>/<path under out>`: the files directly in `out` for tables (a set's tables are in
    subfolders of the default's), the whole tree for plots. Returns the run id (None: MLflow
    is off or failed; a warning says why)."""
    out = Path(out)
    files = sorted(p for p in (out.rglob("*") if what == "plots" else out.iterdir())
                   if p.is_file())
    config = next((Path(d) / "config.yaml" for d in cell_dirs
                   if (Path(d) / "config.yaml").is_file()), None)
    if config is None:
        log.warning("no cell with a config.yaml among %d cells: the study's MLflow run is not "
                    "updated with %s", len(cell_dirs), out)
        return None
    data = read_yaml(config)
    for key in ("study", "results_dir"):
        if key not in data:
            raise ValueError(f"{config}: no {key!r}: not a cell's resolved config")
    cfg = from_dict(TrackingConfig, data.get("tracking", {}), source=str(config),
                    path="tracking")
    study, results = data["study"], Path(data["results_dir"])
    folder = study_run_dir(results, grid_set)
    tags = {KIND_TAG: STUDY_KIND, "study": study, **({"set": grid_set} if grid_set else {}),
            # the run's description in the UI
            "mlflow.note.content": f"The tables and plots of study {study}"
            + (f", grid set {grid_set}" if grid_set else "") + ". A cell's run names the "
            f"study's run in its tag {STUDY_RUN_TAG}."}
    with _locked(folder), Tracker(folder, cfg, study=study,
                                  run_name=study_run_name(study, grid_set), results_dir=results,
                                  tags=tags, out_dir=folder / what) as tracker:
        for path in files:
            tracker.log_artifact(path, Path(what, path.relative_to(out).parent).as_posix())
        return tracker.run_id if tracker.mlflow_enabled else None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock beside `folder` (waiting for it): one job at a time opens the
    study run, so the first creates it and the other finds its link."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError as e:  # a file system without locks: the rules rarely overlap
            log.warning("no lock on %s (%s); going on without", f.name, e)
        yield
