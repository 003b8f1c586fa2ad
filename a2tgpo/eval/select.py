"""Checkpoint selection: which checkpoint of a grid cell the tables report.

Two criteria (DESIGN §3 "Selection and evaluation"):

- `dev_em` (the default): the best greedy validation EM (`val/em` in the cell's metrics.jsonl,
  logged by training on the dev split held out from the training data) among the steps whose
  checkpoint still exists and is complete. Test data plays no part.
- `test_avg`: the papers' protocol (A2TGPO §5.2, algorithms.md §10.5): every checkpoint is
  evaluated on the test sets (`a2tgpo evaluate --all-checkpoints`, which writes
  `<cell>/eval_all/step_NNNNNN/summary.json`) and the one with the best sample-weighted average
  EM over all test questions is chosen. This selects on the test set; tables label it so.

Which step is best is one rule, `best_step` (a2tgpo/train/best.py), shared with training's
own best-step bookkeeping (a2tgpo/train/rl.py) and the sweeps' objective (a2tgpo/sweep.py):
the best value wins by a strict comparison, so ties go to the EARLIEST step (the first
checkpoint that reached it); step 0 (the starting policy, saved before the first update) is a
candidate only for a method that does not train (ReAct, `method.train: false` in the cell's
config.yaml). A trained method reports a trained checkpoint, as the papers do (they save every
20 steps from step 20); otherwise a cell whose training has not yet beaten its warm start would
silently report the starting policy, and every method's row would be ReAct's.

`<cell>/best.json` (written atomically):

    {"criterion": "dev_em" | "test_avg",
     "label": "dev EM" | "best test average (papers' protocol)",
     "step": int,
     "checkpoint": "checkpoints/step_NNNNNN/model",   # relative to the cell directory
     "value": float,                                   # the winning val/em or test average
     "candidates": {"<step>": value, ...}}             # every step considered, ascending
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Literal

from a2tgpo.algo.methods import MethodConfig
from a2tgpo.config import ConfigError, load_config
from a2tgpo.io import atomic_write_json
from a2tgpo.tracking import METRICS_FILE, SUMMARY_FILE, read_metrics
from a2tgpo.train.best import best_step, is_candidate
from a2tgpo.train.checkpoint import checkpoint_step, list_checkpoints

log = logging.getLogger(__name__)

Criterion = Literal["dev_em", "test_avg"]
CRITERIA: tuple[str, ...] = ("dev_em", "test_avg")
LABELS: dict[str, str] = {"dev_em": "dev EM",
                          "test_avg": "best test average (papers' protocol)"}
BEST_FILE = "best.json"
EVAL_ALL_DIR = "eval_all"
DEV_METRIC = "val/em"
MODEL_SUBDIR = "model"


class SelectionError(ValueError):
    """No checkpoint can be selected; the message names the file(s) and what is missing."""


def step_dir_name(step: int) -> str:
    """`step_NNNNNN`, the name of a checkpoint directory and of its eval_all directory."""
    return f"step_{step:06d}"


def complete_checkpoints(cell_dir: str | Path) -> dict[int, Path]:
    """step -> model directory of every complete checkpoint of the cell (ascending steps)."""
    return {checkpoint_step(p): p / MODEL_SUBDIR for p in list_checkpoints(cell_dir)}


def dev_em_by_step(cell_dir: str | Path) -> dict[int, float]:
    """step -> `val/em` from the cell's metrics.jsonl; a step logged twice (a resumed run
    repeats the steps after its last checkpoint) keeps its LATER row. Rows without the metric,
    or with null (non-finite) values, are skipped."""
    values: dict[int, float] = {}
    for row in read_metrics(cell_dir):
        value = row.get(DEV_METRIC)
        if value is None:
            continue
        values[int(row["step"])] = float(value)  # later rows overwrite earlier ones
    return dict(sorted(values.items()))


def test_avg_by_step(eval_all_dir: str | Path) -> dict[int, dict]:
    """step -> the summary.json that `evaluate --all-checkpoints` wrote for that step."""
    root = Path(eval_all_dir)
    out: dict[int, dict] = {}
    if not root.is_dir():
        return out
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        try:
            step = checkpoint_step(d)
        except ValueError:
            continue
        path = d / SUMMARY_FILE
        if not path.is_file():
            continue  # an evaluation that never finished (summary.json is written last)
        summary = json.loads(path.read_text())
        if summary.get("step") != step:
            raise SelectionError(f"{path}: step {summary.get('step')!r} does not match its "
                                 f"directory {d.name}")
        try:
            summary["groups"]["all"]["em"]
        except (KeyError, TypeError):
            raise SelectionError(f"{path}: no groups.all.em (not written by "
                                 "`a2tgpo evaluate --all-checkpoints`?)") from None
        out[step] = summary
    return out


def method_trains(cell_dir: str | Path) -> bool:
    """`method.train` of the cell's config.yaml (the resolved TrainConfig training ran with)."""
    path = Path(cell_dir) / "config.yaml"
    try:
        return load_config(MethodConfig, path, section="method").train
    except ConfigError as e:
        raise SelectionError(f"{e} (selection reads method.train there: step 0 is a candidate "
                             "only for a method that does not train)") from None


def select_checkpoint(cell_dir: str | Path, criterion: Criterion = "dev_em", *,
                      trains: bool | None = None,
                      eval_all_dir: str | Path | None = None) -> dict:
    """The best.json record for `cell_dir` under `criterion` (see the module docstring).
    `trains`: whether the cell's method trains; None = read it from the cell's config.yaml.

    Raises SelectionError naming the files when no step has both a complete checkpoint and a
    value (dev_em: a validation row; test_avg: an eval_all summary), when only step 0 has one
    for a trained method, and, for test_avg, when some complete checkpoints were not evaluated
    or the summaries cover different test sets (their averages would not be comparable).
    """
    cell = Path(cell_dir)
    if criterion not in CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}; expected one of {CRITERIA}")
    if trains is None:
        trains = method_trains(cell)
    ckpts = complete_checkpoints(cell)
    if not ckpts:
        raise SelectionError(f"{cell / 'checkpoints'}: no complete checkpoint (a directory "
                             "step_NNNNNN with a COMPLETE marker)")
    if criterion == "dev_em":
        metrics = cell / METRICS_FILE
        if not metrics.is_file():
            raise SelectionError(f"{metrics}: not found; dev_em selection reads the cell's "
                                 "validation rows from it")
        values = dev_em_by_step(cell)
        candidates = {s: v for s, v in values.items() if s in ckpts}
        if not candidates:
            raise SelectionError(
                f"{metrics}: no {DEV_METRIC} row matches a complete checkpoint "
                f"(validated steps {sorted(values) or 'none'}; checkpoints {sorted(ckpts)} "
                f"in {cell / 'checkpoints'})")
        dropped = sorted(set(values) - set(candidates))
        if dropped:  # pruned by training (keep_last), which keeps the best step itself
            log.info("%s: validated steps without a checkpoint, not candidates: %s", cell,
                     dropped)
    else:
        root = Path(eval_all_dir) if eval_all_dir is not None else cell / EVAL_ALL_DIR
        summaries = test_avg_by_step(root)
        missing = sorted(set(ckpts) - set(summaries))
        if missing:
            raise SelectionError(
                f"{root}: no summary.json for checkpoint steps {missing} of {cell}; run "
                "`a2tgpo evaluate --all-checkpoints` first (test_avg compares every "
                "checkpoint)")
        gone = sorted(set(summaries) - set(ckpts))
        if gone:
            log.warning("%s: evaluated steps %s no longer have a complete checkpoint; not "
                        "candidates", root, gone)
        summaries = {s: v for s, v in summaries.items() if s in ckpts}
        datasets = {s: sorted(v.get("datasets", {})) for s, v in summaries.items()}
        first = min(datasets)
        differ = [s for s in datasets if datasets[s] != datasets[first]]
        if differ:
            raise SelectionError(
                f"{root}: the step summaries cover different test sets (step {first}: "
                f"{datasets[first]}; step {differ[0]}: {datasets[differ[0]]}); re-run "
                "`a2tgpo evaluate --all-checkpoints` with one set of test files")
        candidates = {s: float(v["groups"]["all"]["em"]) for s, v in summaries.items()}
    candidates = {s: v for s, v in candidates.items() if is_candidate(s, trains=trains)}
    if not candidates:
        raise SelectionError(f"{cell}: a trained method reports a trained checkpoint, but only "
                             f"step 0 (the starting policy) has a {criterion} value")
    bad = [s for s, v in candidates.items() if not math.isfinite(v)]
    if bad:
        raise SelectionError(f"{cell}: non-finite {criterion} values at steps {bad}")
    step = best_step(candidates, trains=trains)
    return {
        "criterion": criterion,
        "label": LABELS[criterion],
        "step": step,
        "checkpoint": str(ckpts[step].relative_to(cell)),
        "value": candidates[step],
        "candidates": {str(s): v for s, v in sorted(candidates.items())},
    }


def write_best(cell_dir: str | Path, criterion: Criterion = "dev_em", *,
               out: str | Path | None = None, eval_all_dir: str | Path | None = None) -> dict:
    """Select (`select_checkpoint`) and write the record atomically to `out`
    (default `<cell>/best.json`); returns the record."""
    best = select_checkpoint(cell_dir, criterion, eval_all_dir=eval_all_dir)
    path = Path(out) if out is not None else Path(cell_dir) / BEST_FILE
    atomic_write_json(path, best)
    log.info("%s: selected step %d by %s (%.4f among %d candidates) -> %s", cell_dir,
             best["step"], best["label"], best["value"], len(best["candidates"]), path)
    return best


def read_best(path: str | Path, cell_dir: str | Path) -> dict:
    """Read and check a best.json: its checkpoint (relative to `cell_dir`) must resolve, after
    `..` and symlinks, inside `cell_dir` and be the model directory of a complete checkpoint.
    Adds "model_dir", its path under `cell_dir`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such selection file; run `a2tgpo select <cell>` "
                                "first")
    try:
        best = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SelectionError(f"{path}: not valid JSON: {e}") from e
    for key in ("criterion", "label", "step", "checkpoint"):
        if key not in best:
            raise SelectionError(f"{path}: missing key {key!r} (written by `a2tgpo select`?)")
    checkpoint = best["checkpoint"]
    if not isinstance(checkpoint, str) or not checkpoint:
        raise SelectionError(f"{path}: checkpoint: expected a path relative to the cell, got "
                             f"{checkpoint!r}")
    # the cell's own checkpoint, never another run's: '..', an absolute path or a symlink that
    # leaves the folder would evaluate that run as this cell's result
    model_dir = Path(cell_dir) / checkpoint
    real, cell_real = model_dir.resolve(), Path(cell_dir).resolve()
    if not real.is_relative_to(cell_real):
        raise SelectionError(f"{path}: checkpoint: {checkpoint!r} resolves to {real}, outside "
                             f"the cell's run folder {cell_real}; best.json names a checkpoint "
                             "of its own cell (`a2tgpo select <cell>` writes one)")
    if not (model_dir.parent / "COMPLETE").is_file() or not model_dir.is_dir():
        raise SelectionError(f"{path}: checkpoint {best['checkpoint']!r} is not a complete "
                             f"checkpoint's model directory under {cell_dir}")
    if checkpoint_step(model_dir.parent) != best["step"]:
        raise SelectionError(f"{path}: step {best['step']} does not match checkpoint "
                             f"{best['checkpoint']!r}")
    return {**best, "model_dir": model_dir}
