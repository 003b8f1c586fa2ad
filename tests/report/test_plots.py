"""Plots: PNGs for the data given, clean skips without data, and the series they draw."""

import json
import logging

import numpy as np
import pytest

from a2tgpo.cli import main as cli_main
from a2tgpo.report import ReportConfig, discover_cells
from a2tgpo.report.plots import (
    PLOT_KINDS,
    _smooth,
    _Writer,
    outcome_bars,
    seed_band,
    series,
    warm_start,
    write_plots,
)

M, S = "multi_hop", "single_hop"
PNG = b"\x89PNG\r\n\x1a\n"


def metrics(shift: float, steps: int = 4) -> list[dict]:
    """Training rows as the RL loop logs them: a validation row at step 0, then per step the
    training metrics (with val/em every second step), and step 2 logged again after a resume."""
    rows = [{"step": 0, "time": 0.0, "val/em": 0.10 + shift, **outcomes(0.10 + shift)}]
    for s in range(1, steps + 1):
        row = {"step": s, "time": float(s), "train/reward": 0.1 * s + shift,
               "train/em": 0.05 * s, "rollout/entropy": 1.0 - 0.1 * s,
               "rollout/tool_calls": 1.4, "rollout/tool_calls_dist/0": 0.2,
               "rollout/tool_calls_dist/1": 0.2, "rollout/tool_calls_dist/2": 0.6,
               "time/rollout": 2.0, "time/info_gain+old_logprob": 0.5,
               "time/ref_logprob": 0.2, "time/advantage": 0.1, "time/update": 1.0,
               "time/step": 4.0}
        for k in range(2):
            row.update({f"adv/turn{k}/mean": 0.1 * k - 0.05, f"adv/turn{k}/std": 0.5,
                        f"adv/turn{k}/min": -1.0 - k, f"adv/turn{k}/max": 1.0 + k,
                        f"clip/later/by_turn/{k}": 0.02 * (k + 1) + shift / 10})
        if s % 2 == 0:
            rows.append({"step": s, "val/em": 0.1 + 0.05 * s + shift, "val/f1": 0.3,
                         **outcomes(0.1 + 0.05 * s + shift)})
            row["val/em"] = 0.1 + 0.05 * s + shift
        rows.append(row)
    rows.append({**rows[3], "train/reward": 9.0})  # step 2 again, resumed: this value wins
    return rows


def outcomes(correct: float) -> dict:
    """val/outcome/* as validation logs them: `correct`, the rest split 1 : 3 between
    not_copied and query_missed, and the same shares within the one hop type logged."""
    rest = 1.0 - correct
    shares = {"correct": correct, "limit": 0.0, "format": 0.0, "not_copied": rest / 4,
              "stopped_early": 0.0, "query_missed": 3 * rest / 4}
    return {**{f"val/outcome/{k}": v for k, v in shares.items()},
            **{f"val/outcome/bridge/{k}": v for k, v in shares.items()}}


ROLLOUTS = [
    {"step": s, "group": "q1", "index": i, "reward": 1.0,
     "turns": [{"turn": 0, "stop": "search", "text": "t", "query": q},
               {"turn": 1, "stop": "answer", "text": "the answer is x", "query": None}]}
    for s in (1, 4) for i, q in enumerate(["capital of france", "france capital city"])
]


def full_grid(make_cell):
    summary = dict(datasets={"hotpotqa": (.4, M), "nq": (.5, S)}, groups={M: .4, S: .5})
    for seed in (0, 1):
        make_cell("qwen3-4b", "grpo", "0", seed, metrics=metrics(0.01 * seed), **summary)
        make_cell("qwen3-4b", "a2tgpo", "0.3", seed, metrics=metrics(0.1 + 0.01 * seed),
                  rollouts=ROLLOUTS, **summary)
    make_cell("qwen3-4b", "igpo", "0", 0, metrics=metrics(0.05), **summary)
    make_cell("qwen3-4b", "a2tgpo", "0.1", 0, datasets={"hotpotqa": (.45, M), "nq": (.5, S)},
              groups={M: .45, S: .52})
    return make_cell.runs


def test_series_later_row_wins_and_seed_band():
    rows = metrics(0.0)
    reward = series(rows, "train/reward")
    assert list(reward) == [1, 2, 3, 4] and reward[2] == 9.0 and reward[3] == pytest.approx(0.3)
    # val/em from the validation-only rows and the training rows alike (same values here)
    assert series(rows, "val/em") == pytest.approx({0: 0.1, 2: 0.2, 4: 0.3})
    # seeds {1: 1, 2: 3} and {1: 3}: step 1 mean 2, std sqrt(2); step 2 mean 3, std undefined
    x, mean, std = seed_band([{1: 1.0, 2: 3.0}, {1: 3.0}])
    assert list(x) == [1, 2] and list(mean) == [2.0, 3.0]
    assert std[0] == pytest.approx(np.sqrt(2)) and np.isnan(std[1])
    # trailing moving average over 2 points: 1, (1+3)/2, (3+5)/2
    assert _smooth({1: 1.0, 2: 3.0, 3: 5.0}, 2) == {1: 1.0, 2: 2.0, 3: 4.0}


@pytest.fixture
def figures(monkeypatch):
    """{kind: the matplotlib figure write_plots saved}, drawn (so artists have their places)."""
    drawn = {}
    save = _Writer.save

    def keep(self, fig, backbone, kind, note=None):
        fig.canvas.draw()
        drawn[kind] = fig
        save(self, fig, backbone, kind, note)

    monkeypatch.setattr(_Writer, "save", keep)
    return drawn


def warm_lines(fig) -> list:
    return [ln for ax in fig.axes for ln in ax.get_lines()
            if ln.get_label() == "starting policy (step 0)"]


def test_warm_start_is_the_mean_step_0_value_of_the_cells_that_logged_it():
    # step-0 val/em: 0.10 + shift; metrics(0.05) without its first row has no step 0, and an
    # empty cell none either: (0.10 + 0.12) / 2
    assert warm_start([metrics(0.0), metrics(0.02), metrics(0.05)[1:], []]) == \
        pytest.approx(0.11)
    # step 0 logged twice (a job that restarted before its first step): the later value
    assert warm_start([[{"step": 0, "val/em": 0.2}, {"step": 0, "val/em": 0.4}]]) == \
        pytest.approx(0.4)
    assert warm_start([metrics(0.0)[1:], []]) is None
    assert warm_start([]) is None
    assert warm_start([metrics(0.0)], "train/reward") is None  # training logs from step 1


def test_curves_draw_the_warm_start_and_every_legend_sits_outside_the_data(
        make_cell, tmp_path, figures):
    write_plots(ReportConfig(), discover_cells(full_grid(make_cell)), tmp_path)
    assert sorted(figures) == sorted(PLOT_KINDS)
    # dev EM starts at 100 * (0.10 + shift) in the cells drawn: grpo 0.00 and 0.01, igpo 0.05,
    # a2tgpo (β 0.3) 0.10 and 0.11, so the warm start is 10 + 27 / 5 = 15.4
    (line,) = warm_lines(figures["dev_em"])
    assert line.get_linestyle() == "--" and list(line.get_ydata()) == pytest.approx([15.4] * 2)
    assert not warm_lines(figures["reward"]) and not warm_lines(figures["entropy"])
    for kind, fig in figures.items():
        legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
        assert legends, f"{kind}: no legend"
        for legend in legends:
            box = legend.get_window_extent()
            for ax in fig.axes:
                assert not box.overlaps(ax.get_window_extent()), \
                    f"{kind}: the legend covers the panel {ax.get_title()!r}"


def test_every_plot_is_written_for_full_data(make_cell, tmp_path):
    runs = full_grid(make_cell)
    out = tmp_path / "plots"
    written = write_plots(ReportConfig(), discover_cells(runs), out)
    assert sorted(p.name for p in written) == sorted(f"{k}.png" for k in PLOT_KINDS)
    for p in written:
        assert p.parent == out / "qwen3-4b"
        data = p.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    index = json.loads((out / "index.json").read_text())
    assert index["skipped"] == []
    assert {e["kind"]: e["caption"] for e in index["plots"]}["jaccard"] == "plot_jaccard.rst"


def test_advantage_and_clip_plots_print_their_numbers(make_cell, tmp_path):
    write_plots(ReportConfig(), discover_cells(full_grid(make_cell)), tmp_path)
    notes = {e["kind"]: e.get("note") for e in
             json.loads((tmp_path / "index.json").read_text())["plots"]}
    # adv/turn{k}/mean = 0.1 k − 0.05 at every step: −0.05, +0.05; last − first +0.10; IGPO
    # from its one cell, GRPO from its two, A2TGPO from its β = 0.3 cells (the main table's)
    assert notes["advantage_by_turn"] == (
        "Mean advantage at turn positions 0, 1, ...: GRPO -0.05 / +0.05; last − first +0.10 | "
        "IGPO -0.05 / +0.05; last − first +0.10 | A2TGPO -0.05 / +0.05; last − first +0.10.")
    # clip/later/by_turn/k = 0.02 (k + 1) + shift / 10; A2TGPO β 0.3 has shifts 0.10 and 0.11:
    # turn 0: 0.02 + 0.0105 = 3.05 %, turn 1: 0.04 + 0.0105 = 5.05 %; β 0.1 logged no metrics
    assert notes["clip_by_turn"] == (
        "Clipped tokens (%) at turn positions 0, 1, ... in the updates after each step's first: "
        "β=0.3 3.05 / 5.05.")
    assert all(notes[k] is None for k in notes if k not in ("advantage_by_turn",
                                                           "clip_by_turn"))


def test_outcome_bars_start_and_last_validation_mean_over_seeds(make_cell):
    runs = full_grid(make_cell)
    cells = {m: [c for c in discover_cells(runs) if c.method == m and c.beta in (0.0, 0.3)]
             for m in ("grpo", "a2tgpo")}
    bars = outcome_bars(ReportConfig(), cells)
    assert list(bars) == ["starting policy", "GRPO", "A2TGPO"]
    # step 0 of grpo seed 0: correct = 0.10 + 0.00 (metrics(0.01 * seed), seed 0)
    assert bars["starting policy"][0] == 0
    assert bars["starting policy"][1]["correct"] == pytest.approx(0.10)
    # last validation, step 4: correct = 0.1 + 0.05 * 4 + shift; grpo shifts 0.00 and 0.01,
    # a2tgpo 0.10 and 0.11: means 0.305 and 0.405; query_missed = 3/4 of the rest
    assert bars["GRPO"][0] == 4
    assert bars["GRPO"][1]["correct"] == pytest.approx(0.305)
    assert bars["A2TGPO"][1]["correct"] == pytest.approx(0.405)
    assert bars["A2TGPO"][1]["query_missed"] == pytest.approx(0.75 * (1 - 0.405))
    assert bars["A2TGPO"][1]["bridge/not_copied"] == pytest.approx(0.25 * (1 - 0.405))


def test_plots_skip_cleanly_without_data(make_cell, tmp_path, caplog, capsys):
    # one evaluated cell, no metrics, no rollouts, one β: nothing can be drawn
    make_cell("qwen3-4b", "a2tgpo", "0.3", 0, datasets={"nq": (.5, S)}, groups={S: .5})
    out = tmp_path / "plots"
    with caplog.at_level(logging.INFO, logger="a2tgpo.report"):
        assert cli_main(["plots", "--runs", str(make_cell.runs), "--out", str(out)]) == 0
    assert "no plots written" in capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    assert index["plots"] == [] and sorted(s["kind"] for s in index["skipped"]) == \
        sorted(PLOT_KINDS)
    assert "plot dev_em [qwen3-4b] skipped: no cell logged val/em" in caplog.text
    assert "plot beta [qwen3-4b] skipped: fewer than two evaluated β values" in caplog.text
    assert not list(out.rglob("*.png"))


def test_plots_with_no_cells_at_all(tmp_path, capsys):
    (tmp_path / "runs").mkdir()
    assert cli_main(["plots", "--runs", str(tmp_path / "runs"), "--out",
                     str(tmp_path / "plots")]) == 0
    assert json.loads((tmp_path / "plots" / "index.json").read_text()) == \
        {"plots": [], "skipped": []}
    assert cli_main(["plots", "--out", str(tmp_path / "p")]) == 2  # neither --runs nor --cells
    assert "give --runs DIR or --cells" in capsys.readouterr().err


def test_partial_data_draws_what_it_can(make_cell, tmp_path, figures):
    # metrics without adv/* or time/* keys, and no rollouts: the curves and the tool-call
    # plot only
    rows = [{"step": s, "train/reward": 0.1 * s, "rollout/entropy": 1.0, "val/em": 0.2,
             "rollout/tool_calls_dist/1": 1.0} for s in (1, 2)]
    make_cell("toy", "grpo", "0", 0, metrics=rows)
    written = write_plots(ReportConfig(), discover_cells(make_cell.runs), tmp_path)
    assert sorted(p.stem for p in written) == ["dev_em", "entropy", "reward", "tool_calls"]
    assert not warm_lines(figures["dev_em"])  # no cell validated at step 0


def test_corrupt_metrics_is_an_error_naming_the_line(make_cell, tmp_path, capsys):
    cell = make_cell("toy", "grpo", "0", 0, metrics=[])
    (cell / "metrics.jsonl").write_text('{"step": 1\n{"step": 2}\n')
    assert cli_main(["plots", "--runs", str(make_cell.runs), "--out", str(tmp_path / "p")]) == 1
    assert "metrics.jsonl:1: not valid JSON" in capsys.readouterr().err


def test_time_per_stage_notes_the_rollout_numbers(make_cell, tmp_path):
    # GRPO's two seeds log engine_busy 0.5 and 0.7 at every step (mean 60%), longest
    # trajectory 10 s and 14 s (12.0 s), search wait 1 s and 2 s (1.5 s); IGPO logs none
    def timed(seed):
        return [{**r, "rollout/engine_busy": 0.5 + 0.2 * seed,
                 "rollout/longest_trajectory_s": 10.0 + 4 * seed,
                 "rollout/search_wait_s": 1.0 + seed} if "time/step" in r else r
                for r in metrics(0.0)]

    for seed in (0, 1):
        make_cell("qwen3-4b", "grpo", "0", seed, metrics=timed(seed))
    make_cell("qwen3-4b", "igpo", "0", 0, metrics=metrics(0.0))
    write_plots(ReportConfig(), discover_cells(make_cell.runs), tmp_path)
    notes = {e["kind"]: e.get("note") for e in
             json.loads((tmp_path / "index.json").read_text())["plots"]}
    assert notes["time_per_stage"] == (
        "Rollout per step (mean): GRPO engine busy 60%, longest trajectory 12.0 s, "
        "search wait 1.5 s per trajectory.")
