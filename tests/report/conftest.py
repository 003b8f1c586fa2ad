"""Synthetic grid cells for the report tests: files laid out as the training and evaluation
stages write them, with numbers chosen in each test so the expected output is worked out by
hand there."""

import json
from pathlib import Path

import pytest


def write_cell(runs: Path, backbone: str, method: str, beta: str, seed: int | str, *,
               datasets: dict[str, tuple[float, str]] | None = None,
               groups: dict[str, float] | None = None, criterion: str = "dev_em",
               label: str | None = "dev-selected", metrics: list[dict] | None = None,
               rollouts: list[dict] | None = None) -> Path:
    """One cell directory. `datasets`: name -> (EM fraction, group); `groups`: name -> EM.
    F1 is written as EM / 2 so that a test can tell the two metrics apart."""
    cell = runs / f"backbone~{backbone}" / f"method~{method}" / f"beta~{beta}" / f"seed~{seed}"
    cell.mkdir(parents=True)
    (cell / "config.yaml").write_text(f"method: {method}\n")
    if datasets is not None:
        summary = {
            "step": 20, "checkpoint": "checkpoints/step_20", "criterion": criterion,
            "datasets": {n: {"n": 100, "em": em, "f1": em / 2, "group": g}
                         for n, (em, g) in datasets.items()},
            "groups": {g: {"n": 100, "em": em, "f1": em / 2} for g, em in (groups or {}).items()},
        }
        if label is not None:
            summary["label"] = label
        (cell / "eval").mkdir()
        (cell / "eval" / "summary.json").write_text(json.dumps(summary))
        (cell / "best.json").write_text(json.dumps({"criterion": criterion, "step": 20}))
    if metrics is not None:
        (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    if rollouts is not None:
        (cell / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    return cell


@pytest.fixture
def make_cell(tmp_path):
    runs = tmp_path / "runs"

    def make(*args, **kwargs):
        return write_cell(runs, *args, **kwargs)

    make.runs = runs
    return make
