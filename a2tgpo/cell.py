"""A grid cell: one training run, named by the path of its folder under <results>/<study>/runs/

    backbone~qwen3-4b/method~a2tgpo/beta~0.3/seed~1
    backbone~qwen3-4b/data~multi_hop/method~a2tgpo/beta~0.3/seed~1   (studies with tracks)
    backbone~toy/regime~bench/method~a2tgpo/beta~0.3/seed~1   (a set trained under a regime)

so a results folder explains itself and `snakemake <cell>/eval/summary.json` reruns exactly one
cell. Betas are written with Python's shortest round-trip float repr (0.3, never
0.30000000000000004; integers without ".0"), and `Cell.parse(cell.path) == cell`.

The grid (a2tgpo/grid.py) makes cells; the report (a2tgpo/report) reads them back from their
folders (`Cell.from_dir`) together with the files training and evaluation left there:
`metrics.jsonl` (through `a2tgpo.tracking.read_metrics`) and `eval/summary.json`, each read once.
Standard library only, so the report does not import the training stack.
"""

from __future__ import annotations

import datetime
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from a2tgpo.config import format_value

SUMMARY = Path("eval") / "summary.json"

# wildcard regex for Snakemake; the regime~ component appears only in cells of a set trained
# under a named regime (train.regimes), the data~ component only in studies with tracks
CELL_PATTERN = (r"backbone~[A-Za-z0-9_.\-]+(/regime~[a-z0-9_]+)?(/data~[a-z0-9_]+)?"
                r"/method~[a-z0-9_]+/beta~[0-9.e+\-]+/seed~[0-9]+")
_CELL = (r"backbone~(?P<backbone>[A-Za-z0-9_.\-]+)(/regime~(?P<regime>[a-z0-9_]+))?"
         r"(/data~(?P<data>[a-z0-9_]+))?"
         r"/method~(?P<method>[a-z0-9_]+)/beta~(?P<beta>[0-9.e+\-]+)/seed~(?P<seed>[0-9]+)")
_CELL_RE = re.compile(f"^{_CELL}$")
_DIR_RE = re.compile(f"(^|/){_CELL}$")  # a folder whose last components are a cell path
_LAYOUT = "backbone~<b>[/regime~<r>][/data~<track>]/method~<m>/beta~<β>/seed~<n>"


class ReportInputError(ValueError):
    """A result file the report reads (or a cell folder's name) is malformed; the message names
    the file and the key."""


def normalize_beta(x: float) -> float:
    """Round to 10 significant digits so sums like 0.1 + 0.2 become the 0.3 users wrote."""
    return float(f"{float(x):.10g}")


@dataclass(frozen=True, order=True)
class Cell:
    """One grid point. `data` names the training track (e.g. multi_hop: trained on HotpotQA,
    tested on the multi-hop sets, as the papers train one model per track); "" = the study's
    single implicit track, and then the path has no data~ component. `regime` names the
    study's training regime (train.regimes: overrides, e.g. a longer schedule) the cell runs
    under; "" = the study's own train section, and no regime~ component. `run_dir` is the
    folder a cell was read from (`from_dir`; None for a cell the grid made): its files are read
    there."""

    backbone: str
    method: str
    beta: float
    seed: int
    data: str = ""
    regime: str = ""
    run_dir: Path | None = field(default=None, compare=False, repr=False)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def path(self) -> str:
        regime = f"/regime~{self.regime}" if self.regime else ""
        track = f"/data~{self.data}" if self.data else ""
        return (f"backbone~{self.backbone}{regime}{track}/method~{self.method}"
                f"/beta~{format_value(self.beta)}/seed~{self.seed}")

    @property
    def display_name(self) -> str:
        """A short readable name, method first (MLflow run names; the path stays a tag):
        "a2tgpo β=0.3 seed 1 · toy", with " · <track>" for a data track and " · <regime>" for
        a regime."""
        track = f" · {self.data}" if self.data else ""
        regime = f" · {self.regime}" if self.regime else ""
        return (f"{self.method} β={format_value(self.beta)} seed {self.seed} · "
                f"{self.backbone}{track}{regime}")

    @classmethod
    def parse(cls, path: str) -> Cell:
        """The cell of a cell path (relative, as `path` writes it)."""
        m = _CELL_RE.match(path.strip("/"))
        if m is None:
            raise ValueError(f"not a cell path ({_LAYOUT}): {path!r}")
        return cls._of(m, path)

    @classmethod
    def from_dir(cls, run_dir: str | Path) -> Cell:
        """The cell whose folder is `run_dir` (any prefix, e.g. results/toy/runs/<cell path>);
        a folder whose name is no cell path fails, naming the components it lacks."""
        run_dir = Path(run_dir)
        m = _DIR_RE.search(run_dir.as_posix())
        if m is None:
            have = {part.split("~")[0] for part in run_dir.parts}
            missing = [f"{k}~" for k in ("backbone", "method", "beta", "seed") if k not in have]
            why = f"no {', '.join(missing)} component; " if missing else ""
            raise ReportInputError(f"{run_dir}: not a cell directory ({why}expected "
                                   f".../{_LAYOUT})")
        try:
            return cls._of(m, str(run_dir), run_dir)
        except ValueError as e:
            raise ReportInputError(str(e)) from None

    @classmethod
    def _of(cls, m: re.Match, where: str, run_dir: Path | None = None) -> Cell:
        try:
            beta = float(m["beta"])
        except ValueError:
            raise ValueError(f"{where}: beta~{m['beta']} is not a number") from None
        return cls(m["backbone"], m["method"], beta, int(m["seed"]), m["data"] or "",
                   m["regime"] or "", run_dir)

    # ---- the cell's files (the report) -----------------------------------------------------

    @property
    def summary_path(self) -> Path:
        return self._dir() / SUMMARY

    def summary(self) -> dict | None:
        """eval/summary.json, validated; None when the cell has not been evaluated."""
        if "summary" not in self._cache:
            path = self.summary_path
            self._cache["summary"] = load_summary(path) if path.exists() else None
        return self._cache["summary"]

    def metrics(self) -> list[dict] | None:
        """metrics.jsonl rows (via a2tgpo.tracking.read_metrics); None when there is none."""
        if "metrics" not in self._cache:
            from a2tgpo.tracking import METRICS_FILE, read_metrics

            exists = (self._dir() / METRICS_FILE).exists()
            try:
                self._cache["metrics"] = read_metrics(self._dir()) if exists else None
            except ValueError as e:  # a corrupt line: name it, no traceback
                raise ReportInputError(str(e)) from e
        return self._cache["metrics"]

    def _dir(self) -> Path:
        if self.run_dir is None:
            raise ValueError(f"cell {self.path} has no folder (make it with Cell.from_dir)")
        return self.run_dir


def load_summary(path: str | Path) -> dict:
    """Read and check an eval/summary.json; errors name the file and the key."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportInputError(f"{path}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ReportInputError(f"{path}: expected a JSON object")
    for key in ("datasets", "groups"):
        if not isinstance(data.get(key), dict):
            raise ReportInputError(f"{path}: {key}: missing or not an object")
    for section in ("datasets", "groups"):
        for name, entry in data[section].items():
            if not isinstance(entry, dict):
                raise ReportInputError(f"{path}: {section}.{name}: expected an object")
            for metric in ("em", "f1"):
                v = entry.get(metric)
                if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                                      or not math.isfinite(v) or not 0.0 <= v <= 1.0):
                    raise ReportInputError(
                        f"{path}: {section}.{name}.{metric}: expected a fraction in [0, 1], "
                        f"got {v!r}")
    return data


# --------------------------------------------------------------------------------------------
# a cell's archived runs (`a2tgpo rerun`, and training when its inputs changed)


def archive_stamp() -> str:
    """The name of an archived run folder: the UTC time of archiving."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")


def archive_dir(results_root: str, cell_path: str, stamp: str) -> Path:
    """Where a cell's archived run goes: <results>/archive/<cell>/<stamp>/."""
    return Path(results_root) / "archive" / cell_path / stamp


def archive_run(results_root: str, cell: Cell, stamp: str) -> str | None:
    """Move a cell's run folder to <results>/archive/<cell>/<stamp>/ (nothing is deleted);
    returns the new location, or None when the cell never ran."""
    src = Path(results_root) / "runs" / cell.path
    if not src.exists():
        return None
    dst = archive_dir(results_root, cell.path, stamp)
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(src), str(dst))
    return str(dst)
