"""Checkpoint selection on synthetic cells: metrics.jsonl written by the real Tracker, fake
checkpoint directories (a COMPLETE marker and a model/ folder, as save_checkpoint leaves them)."""

import json

import pytest

from a2tgpo.algo.methods import METHODS
from a2tgpo.cli import main
from a2tgpo.config import dump_yaml, to_dict
from a2tgpo.eval.select import (
    SelectionError,
    read_best,
    select_checkpoint,
    write_best,
)
from a2tgpo.tracking import Tracker, TrackingConfig
from a2tgpo.train.best import best_step


def make_cell(root, val_rows, complete=(), incomplete=(), method="grpo"):
    """A cell with `val_rows` [(step, val/em)] logged in order (one Tracker per list element,
    so a list of lists is a run resumed in between), plus training rows without val/em, and the
    method section of its config.yaml (method=None: no config.yaml)."""
    cell = root / "cell"
    cell.mkdir(parents=True)
    if method is not None:
        (cell / "config.yaml").write_text(dump_yaml({"method": to_dict(METHODS[method])}))
    for job in val_rows:
        with Tracker(cell, TrackingConfig(mlflow=False), study="t", run_name="c",
                     results_dir=root) as t:
            for step, em in job:
                t.log({"train/reward": 0.1}, step)  # a training row: no val/em, ignored
                t.log({"val/em": em, "val/f1": 0.0}, step)
    for step in complete:
        d = cell / "checkpoints" / f"step_{step:06d}"
        (d / "model").mkdir(parents=True)
        (d / "COMPLETE").write_text(f"{step}\n")
    for step in incomplete:  # a save killed before COMPLETE was written
        (cell / "checkpoints" / f"step_{step:06d}" / "model").mkdir(parents=True)
    return cell


def test_dev_em_later_row_wins_after_resume(tmp_path):
    # first job: steps 0, 10, 20 (20 scored 0.9), killed after 20 was logged but before its
    # checkpoint; the resumed job (from step 10) logs 20 again (0.4) and 30 (0.6)
    cell = make_cell(tmp_path, [[(0, 0.2), (10, 0.5), (20, 0.9)], [(20, 0.4), (30, 0.6)]],
                     complete=(0, 10, 20, 30))
    best = select_checkpoint(cell)
    # candidates by the later rows: {10: .5, 20: .4, 30: .6} -> step 30 (0.9 is stale; step 0,
    # the starting policy, is no candidate when trained checkpoints exist)
    assert best == {"criterion": "dev_em", "label": "dev EM", "step": 30,
                    "checkpoint": "checkpoints/step_000030/model", "value": 0.6,
                    "candidates": {"10": 0.5, "20": 0.4, "30": 0.6}}


def test_dev_em_only_steps_with_complete_checkpoints(tmp_path):
    # step 30 (0.9, the best) was pruned; step 20 (0.8) has no COMPLETE marker
    cell = make_cell(tmp_path, [[(0, 0.2), (10, 0.5), (20, 0.8), (30, 0.9)]],
                     complete=(0, 10), incomplete=(20,))
    best = select_checkpoint(cell)
    assert best["step"] == 10 and best["value"] == 0.5
    assert best["candidates"] == {"10": 0.5}


def test_dev_em_ties_go_to_the_earliest_step(tmp_path):
    cell = make_cell(tmp_path, [[(0, 0.1), (10, 0.5), (20, 0.3), (30, 0.5)]],
                     complete=(0, 10, 20, 30))
    assert select_checkpoint(cell)["step"] == 10


def test_trained_cell_never_reports_its_starting_policy(tmp_path):
    # the warm start (step 0) scored best on dev, training did not beat it: the cell still
    # reports its best trained checkpoint (10: 0.3 over 20: 0.2), not step 0's 0.4
    cell = make_cell(tmp_path, [[(0, 0.4), (10, 0.3), (20, 0.2)]], complete=(0, 10, 20))
    best = select_checkpoint(cell)
    assert (best["step"], best["value"]) == (10, 0.3)
    assert best["candidates"] == {"10": 0.3, "20": 0.2}


def test_react_cell_has_only_step_zero(tmp_path):
    cell = make_cell(tmp_path, [[(0, 0.25)]], complete=(0,), method="react")
    best = select_checkpoint(cell)
    assert (best["step"], best["checkpoint"], best["value"]) == (
        0, "checkpoints/step_000000/model", 0.25)


def test_trained_cell_with_only_its_starting_policy_is_refused(tmp_path):
    cell = make_cell(tmp_path, [[(0, 0.25)]], complete=(0,))
    with pytest.raises(SelectionError, match=r"cell: a trained method reports a trained "
                       r"checkpoint, but only step 0 .* has a dev_em value"):
        select_checkpoint(cell)
    assert select_checkpoint(cell, trains=False)["step"] == 0  # the caller may say so
    bare = make_cell(tmp_path / "b", [[(0, 0.25)]], complete=(0,), method=None)
    with pytest.raises(SelectionError, match=r"b/cell/config.yaml: file not found \(selection "
                       r"reads method.train"):
        select_checkpoint(bare)


def test_best_step_rule():
    # strict comparison: a tie keeps the earlier step, whatever order the mapping has
    assert best_step({20: 0.5, 10: 0.5, 30: 0.4}, trains=True) == 10
    assert best_step({10: 0.5, 20: 0.6}, trains=True) == 20
    assert best_step({10: 0.5, 20: 0.4, 30: 0.4}, trains=True, maximize=False) == 20
    # step 0 is the starting policy: never a trained method's best, even when it scores best
    assert best_step({0: 0.9, 10: 0.3, 20: 0.2}, trains=True) == 10
    assert best_step({0: 0.9}, trains=True) is None
    assert best_step({}, trains=False) is None
    # ... but a candidate for a method that does not train, winning ties as the earliest
    assert best_step({0: 0.4}, trains=False) == 0
    assert best_step({0: 0.4, 10: 0.4}, trains=False) == 0
    assert best_step({0: 0.1, 10: 0.4}, trains=False, maximize=False) == 0


def test_dev_em_errors_name_the_file(tmp_path):
    cell = make_cell(tmp_path, [[(10, 0.5)]], complete=(0, 20))
    with pytest.raises(SelectionError, match=r"metrics.jsonl: no val/em row matches a complete "
                       r"checkpoint \(validated steps \[10\]; checkpoints \[0, 20\]"):
        select_checkpoint(cell)
    (cell / "metrics.jsonl").unlink()
    with pytest.raises(SelectionError, match=r"cell/metrics.jsonl: not found"):
        select_checkpoint(cell)
    bare = make_cell(tmp_path / "b", [[(0, 0.5)]], incomplete=(0,))
    with pytest.raises(SelectionError, match=r"b/cell/checkpoints: no complete checkpoint"):
        select_checkpoint(bare)


def eval_all_summary(cell, step, em_all, datasets=("a", "b")):
    d = cell / "eval_all" / f"step_{step:06d}"
    d.mkdir(parents=True)
    summary = {"step": step, "checkpoint": f"checkpoints/step_{step:06d}/model",
               "criterion": None, "label": f"step {step}",
               "datasets": {n: {"n": 1, "em": em_all, "f1": em_all, "group": "g"}
                            for n in datasets},
               "groups": {"g": {"n": len(datasets), "em": em_all, "f1": em_all},
                          "all": {"n": len(datasets), "em": em_all, "f1": em_all}}}
    (d / "summary.json").write_text(json.dumps(summary))


def test_test_avg_picks_the_best_overall_average_earliest_on_ties(tmp_path):
    # test averages: 10 and 20 tie at 0.4 -> the earliest, 10 (step 0, the starting policy,
    # is no candidate)
    cell = make_cell(tmp_path, [[(0, 0.9), (10, 0.1), (20, 0.1)]], complete=(0, 10, 20))
    for step, em in ((0, 0.3), (10, 0.4), (20, 0.4)):
        eval_all_summary(cell, step, em)
    (cell / "eval_all" / "step_000030").mkdir()  # an unfinished evaluation: no summary.json
    (cell / "eval_all" / "tracking").mkdir()  # not a step directory
    best = select_checkpoint(cell, "test_avg")
    assert best == {"criterion": "test_avg", "label": "best test average (papers' protocol)",
                    "step": 10, "checkpoint": "checkpoints/step_000010/model", "value": 0.4,
                    "candidates": {"10": 0.4, "20": 0.4}}
    assert select_checkpoint(cell)["step"] == 10  # dev EM: 0.1 at 10 and 20 -> earliest


def test_test_avg_needs_every_checkpoint_and_the_same_test_sets(tmp_path):
    cell = make_cell(tmp_path, [[(0, 0.9)]], complete=(0, 10))
    eval_all_summary(cell, 0, 0.3)
    with pytest.raises(SelectionError, match=r"eval_all: no summary.json for checkpoint steps "
                       r"\[10\]"):
        select_checkpoint(cell, "test_avg")
    eval_all_summary(cell, 10, 0.5, datasets=("a",))
    with pytest.raises(SelectionError, match="cover different test sets"):
        select_checkpoint(cell, "test_avg")


def test_test_avg_ignores_evaluations_of_pruned_checkpoints(tmp_path):
    cell = make_cell(tmp_path, [[(0, 0.9)]], complete=(0, 10))
    for step, em in ((0, 0.3), (10, 0.2), (20, 0.9)):  # step 20's checkpoint is gone
        eval_all_summary(cell, step, em)
    best = select_checkpoint(cell, "test_avg")
    assert best["step"] == 10 and best["candidates"] == {"10": 0.2}


def test_write_best_is_atomic_and_read_back(tmp_path):
    cell = make_cell(tmp_path, [[(0, 0.2), (10, 0.5)]], complete=(0, 10))
    (cell / "best.json").write_text("old")
    best = write_best(cell)
    assert json.loads((cell / "best.json").read_text()) == best
    assert not [p for p in cell.iterdir() if p.name.startswith(".")]  # no temporary left
    back = read_best(cell / "best.json", cell)
    assert back["model_dir"] == cell / "checkpoints" / "step_000010" / "model"
    assert back["step"] == 10


def test_read_best_errors(tmp_path):
    cell = make_cell(tmp_path, [[(0, 0.2)]], complete=(0,), incomplete=(10,))
    with pytest.raises(FileNotFoundError, match=r"cell/best.json: no such selection file"):
        read_best(cell / "best.json", cell)
    (cell / "best.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM", "step": 10,
        "checkpoint": "checkpoints/step_000010/model"}))
    with pytest.raises(SelectionError, match=r"best.json: checkpoint "
                       r"'checkpoints/step_000010/model' is not a complete checkpoint"):
        read_best(cell / "best.json", cell)
    (cell / "best.json").write_text(json.dumps({"criterion": "dev_em", "step": 0}))
    with pytest.raises(SelectionError, match=r"best.json: missing key 'label'"):
        read_best(cell / "best.json", cell)


def _point_best_at(cell, checkpoint, step=10):
    (cell / "best.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM", "step": step, "checkpoint": checkpoint}))
    return cell / "best.json"


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_read_best_refuses_a_checkpoint_outside_the_cell(tmp_path, how):
    # another run's complete step-10 checkpoint, which the cell itself never saved
    cell = make_cell(tmp_path / "a", [[(0, 0.2)]], complete=(0,))
    other = make_cell(tmp_path / "b", [[(10, 0.9)]], complete=(10,))
    target = other / "checkpoints" / "step_000010" / "model"
    if how == "dotdot":
        checkpoint = "../../b/cell/checkpoints/step_000010/model"
    elif how == "absolute":
        checkpoint = str(target)
    else:  # a path inside the cell whose folder is a link to the other run's checkpoint
        (cell / "checkpoints" / "step_000010").symlink_to(target.parent)
        checkpoint = "checkpoints/step_000010/model"
    best = _point_best_at(cell, checkpoint)
    with pytest.raises(SelectionError) as e:
        read_best(best, cell)
    assert str(e.value).startswith(
        f"{best}: checkpoint: {checkpoint!r} resolves to {target.resolve()}, outside the cell's "
        f"run folder {cell.resolve()}")


def test_read_best_accepts_a_path_that_stays_in_the_cell(tmp_path):
    cell = make_cell(tmp_path, [[(10, 0.5)]], complete=(0, 10))
    best = _point_best_at(cell, "checkpoints/step_000000/../step_000010/model")
    assert read_best(best, cell)["model_dir"].resolve() == \
        (cell / "checkpoints" / "step_000010" / "model").resolve()


def test_evaluate_refuses_another_runs_checkpoint(tmp_path, capsys):
    """`a2tgpo evaluate --best` stops on such a best.json before it loads anything."""
    import dataclasses
    from pathlib import Path

    from a2tgpo.config import dump_config
    from a2tgpo.study import load_study, resolve_cell

    root = Path(__file__).resolve().parents[2]
    cell = make_cell(tmp_path / "a", [[(0, 0.2)]], complete=(0,))
    make_cell(tmp_path / "b", [[(10, 0.9)]], complete=(10,))
    study = load_study(root / "config/config.yaml", [f"backbones_dir={root}/config/backbones",
                                                     f"methods_dir={root}/config/methods"])
    cfg = resolve_cell(study, "backbone~toy_reader/data~multi_hop/method~grpo/beta~0/seed~1")
    dump_config(dataclasses.replace(cfg, run_dir=str(cell)), cell / "config.yaml")
    best = _point_best_at(cell, "../../b/cell/checkpoints/step_000010/model")
    out = tmp_path / "eval"
    assert main(["evaluate", str(cell / "config.yaml"), "--best", str(best), "--test",
                 str(tmp_path / "none.parquet"), "--out", str(out)]) == 1
    assert f"a2tgpo evaluate: error: {best}: checkpoint: " in capsys.readouterr().err
    assert not out.exists()


def test_select_command(tmp_path, capsys):
    cell = make_cell(tmp_path, [[(0, 0.2), (10, 0.5)]], complete=(0, 10))
    assert main(["select", str(cell)]) == 0
    assert json.loads((cell / "best.json").read_text())["step"] == 10
    assert "step 10 by dev EM" in capsys.readouterr().out
    out = tmp_path / "elsewhere" / "best_test.json"
    assert main(["select", str(cell), "--criterion", "test_avg", "--out", str(out)]) == 1
    assert "eval_all: no summary.json for checkpoint steps [0, 10]" in capsys.readouterr().err
    assert not out.exists()
