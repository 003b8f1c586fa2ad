"""Cells: paths round-trip, folders parse back to the grid's cells, result files read once."""

import json

import pytest

from a2tgpo.cell import Cell, ReportInputError, normalize_beta
from a2tgpo.config import format_value


@pytest.mark.parametrize("beta, text", [(0.0, "0"), (0.3, "0.3"), (1.0, "1"), (0.25, "0.25"),
                                        (1e-7, "1e-07"), (12.0, "12")])
def test_beta_text_round_trips(beta, text):
    assert format_value(beta) == text
    assert float(text) == beta
    cell = Cell("qwen3-4b", "a2tgpo", beta, 2)
    assert Cell.parse(cell.path) == cell


def test_float_noise_is_normalised_away():
    # 0.1 + 0.2 = 0.30000000000000004 in binary floating point; a path must still say 0.3
    assert format_value(0.1 + 0.2) == "0.30000000000000004"
    assert format_value(normalize_beta(0.1 + 0.2)) == "0.3"


def test_track_component_round_trips():
    cell = Cell("qwen3-4b", "grpo", 0.0, 1, "multi_hop")
    assert cell.path == "backbone~qwen3-4b/data~multi_hop/method~grpo/beta~0/seed~1"
    assert Cell.parse(cell.path) == cell


def test_regime_component_round_trips():
    # a regime sits between backbone and track, so the same coordinates trained under another
    # regime get another folder
    cell = Cell("toy", "grpo", 0.0, 1, "multi_hop", "bench")
    assert cell.path == "backbone~toy/regime~bench/data~multi_hop/method~grpo/beta~0/seed~1"
    assert Cell.parse(cell.path) == cell
    plain = Cell("toy", "grpo", 0.0, 1)
    assert Cell.parse("backbone~toy/regime~bench/method~grpo/beta~0/seed~1") != plain
    assert Cell.from_dir(f"results/toy/runs/{cell.path}") == cell
    assert cell.display_name == "grpo β=0 seed 1 · toy · multi_hop · bench"


def test_display_name_puts_method_beta_and_seed_first():
    # MLflow's runs table cuts long names: what tells runs apart must come first
    assert Cell("toy", "a2tgpo", 0.3, 1).display_name == "a2tgpo β=0.3 seed 1 · toy"
    assert Cell("qwen3-4b", "grpo", 0.0, 2, "multi_hop").display_name == \
        "grpo β=0 seed 2 · qwen3-4b · multi_hop"


def test_parse_rejects_other_paths():
    with pytest.raises(ValueError, match="not a cell path"):
        Cell.parse("backbone~toy/method~grpo/seed~1")
    with pytest.raises(ValueError, match=r"beta~1\.2\.3 is not a number"):
        Cell.parse("backbone~toy/method~grpo/beta~1.2.3/seed~1")


def test_a_folder_reads_back_as_the_grid_cell(tmp_path):
    cell = Cell("qwen3-4b", "a2tgpo", 0.3, 2, "multi_hop")
    # the prefix may hold anything, even ~ components of its own
    folder = tmp_path / "results~old" / "runs" / cell.path
    back = Cell.from_dir(folder)
    assert back == cell and back.run_dir == folder
    assert back.summary_path == folder / "eval" / "summary.json"
    # β as the folder writes it: an unnormalised name still reads as the same number
    assert Cell.from_dir(tmp_path / "backbone~b/method~m/beta~0.30/seed~1").beta == 0.3
    with pytest.raises(ReportInputError, match=r"no beta~, seed~ component"):
        Cell.from_dir(tmp_path / "backbone~x" / "method~y")
    # the cell path must end the folder's path
    with pytest.raises(ReportInputError, match="not a cell directory"):
        Cell.from_dir(folder / "eval")
    with pytest.raises(ValueError, match="has no folder"):
        cell.summary()


def test_result_files_are_read_once(tmp_path):
    folder = tmp_path / "backbone~b" / "method~m" / "beta~0" / "seed~1"
    cell = Cell.from_dir(folder)
    assert cell.summary() is None and cell.metrics() is None  # not evaluated, not trained
    fresh = Cell.from_dir(folder)
    (folder / "eval").mkdir(parents=True)
    summary = {"datasets": {"nq": {"n": 2, "em": 0.5}}, "groups": {}}
    (folder / "eval" / "summary.json").write_text(json.dumps(summary))
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/em": 0.5}) + "\n")
    assert fresh.summary() == summary and fresh.metrics()[0]["val/em"] == 0.5
    (folder / "eval" / "summary.json").write_text("not json")
    (folder / "metrics.jsonl").unlink()
    assert fresh.summary() == summary and fresh.metrics()[0]["val/em"] == 0.5  # cached
    with pytest.raises(ReportInputError, match=r"summary.json: not valid JSON"):
        Cell.from_dir(folder).summary()
