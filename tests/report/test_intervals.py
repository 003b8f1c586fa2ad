"""Spread over seeds (95% t-interval or std) and the paired table: numbers worked out by hand.

Quantiles used below: t_{0.975,1} = 12.706205, t_{0.975,2} = 4.302653 (the normal quantile
1.96 would give much narrower intervals at these seed counts, which is what the tests catch).
"""

import math

import pandas as pd
import pytest

from a2tgpo.config import ConfigError
from a2tgpo.report import ReportConfig, discover_cells, load_report_config
from a2tgpo.report.tables import CSV_COLUMNS, build_tables, t_half_width, write_tables

M = "multi_hop"


def cell(make_cell, method, beta, seed, em):
    """One hotpotqa (multi-hop) result, the Multi Avg equal to it."""
    make_cell("qwen3-4b", method, beta, seed, datasets={"hotpotqa": (em, M)}, groups={M: em})


def test_t_half_width_by_hand():
    # 40, 42, 47: mean 43, s² = (9 + 1 + 16) / 2 = 13, half-width 4.302653 · √13 / √3 = 8.9567
    assert t_half_width([40.0, 42.0, 47.0]) == pytest.approx(8.956686, abs=1e-6)
    # two values: t_{0.975,1} · s / √2 with s = |a − b| / √2: 12.706205 · 2 / 2
    assert t_half_width([45.0, 47.0]) == pytest.approx(12.706205, abs=1e-6)
    assert t_half_width([45.0]) is None


def grpo_three_seeds(make_cell):
    # GRPO .40/.42/.47: mean 43.0, s = √13 = 3.6056, t half-width 8.9567; IGPO one seed
    for seed, em in enumerate([.40, .42, .47]):
        cell(make_cell, "grpo", "0", seed, em)
    cell(make_cell, "igpo", "0", 0, .50)
    return discover_cells(make_cell.runs)


def test_default_spread_is_the_t_interval_and_the_caption_says_so(make_cell, tmp_path):
    write_tables(ReportConfig(decimals=3), grpo_three_seeds(make_cell), tmp_path)
    md = (tmp_path / "main.md").read_text()
    assert "| GRPO | 3 | 43.000 ± 8.957 | 43.000 ± 8.957 |" in md
    assert "| IGPO | 1 | **50.000** | **50.000** |" in md  # one seed: no interval
    assert "mean ± the half-width of the two-sided 95% Student-t confidence interval" in md
    assert "standard deviation (n − 1 denominator) over seeds" not in md
    tex = (tmp_path / "main.tex").read_text()
    assert r"Qwen3-4B & GRPO & 3 & 43.000 $\pm$ 8.957 & 43.000 $\pm$ 8.957 \\" in tex
    assert r"\ensuremath{\cdot} s / \ensuremath{\surd}n" in tex


def test_std_spread_prints_the_sample_std(make_cell, tmp_path):
    write_tables(ReportConfig(spread="std", decimals=3), grpo_three_seeds(make_cell), tmp_path)
    md = (tmp_path / "main.md").read_text()
    assert "| GRPO | 3 | 43.000 ± 3.606 | 43.000 ± 3.606 |" in md  # √13
    assert "mean ± sample standard deviation (n − 1 denominator) over seeds" in md
    assert "Student-t" not in md


@pytest.mark.parametrize("spread", ["ci95", "std"])
def test_csv_carries_std_and_ci95_whatever_is_printed(make_cell, tmp_path, spread):
    write_tables(ReportConfig(spread=spread), grpo_three_seeds(make_cell), tmp_path)
    df = pd.read_csv(tmp_path / "main.csv")
    assert list(df.columns) == list(CSV_COLUMNS)
    grpo = df[(df.row == "grpo") & (df.column == "hotpotqa")].iloc[0]
    assert grpo["mean"] == pytest.approx(43.0)
    assert grpo["std"] == pytest.approx(math.sqrt(13))
    assert grpo["ci95"] == pytest.approx(8.956686, abs=1e-6)
    assert pd.isna(grpo["excludes_zero"])  # not a paired difference
    igpo = df[(df.row == "igpo") & (df.column == "hotpotqa")].iloc[0]
    assert pd.isna(igpo["std"]) and pd.isna(igpo["ci95"])  # one seed


def paired_grid(make_cell):
    """Seeds on purpose not aligned, so that pairing by position gives other numbers.

    a2tgpo β 0.3 (the main table's β): seed 0 .30, 1 .45, 2 .47, 3 .52
    a2tgpo β 0 and β 0.5 (not the main table's): seeds 1-3 .10 and .20 (gaps of −30 and −20
      if they were used)
    grpo: seed 1 .40, 2 .42, 3 .44, 4 .60
      common seeds 1, 2, 3 (seed 0 of a2tgpo and 4 of grpo are dropped); differences 5, 5, 8:
      mean 6, s² = (1 + 1 + 4) / 2 = 3, half-width 4.302653 · √3 / √3 = 4.303 -> 6.0 ± 4.3,
      the interval [1.7, 10.3] excludes 0: marked.
      (by position, .30−.40, .45−.42, .47−.44, .52−.60 = −10, 3, 3, −8: mean −3)
    igpo: seed 1 .43, 2 .44, 3 .45
      differences 2, 3, 7: mean 4, s² = (4 + 1 + 9) / 2 = 7, half-width 4.302653 · √7 / √3
      = 6.572 -> 4.0 ± 6.6, the interval [−2.6, 10.6] holds 0: not marked (with the normal
      1.96 instead of t the half-width would be 2.99 and the difference marked).
    dapo: seed 3 .50 and seed 9 .99: one common seed (3), difference 2.0 without interval.
    """
    for seed, em in enumerate([.30, .45, .47, .52]):
        cell(make_cell, "a2tgpo", "0.3", seed, em)
    for seed in (1, 2, 3):
        cell(make_cell, "a2tgpo", "0", seed, .10)
        cell(make_cell, "a2tgpo", "0.5", seed, .20)
    for seed, em in zip((1, 2, 3, 4), (.40, .42, .44, .60), strict=True):
        cell(make_cell, "grpo", "0", seed, em)
    for seed, em in zip((1, 2, 3), (.43, .44, .45), strict=True):
        cell(make_cell, "igpo", "0", seed, em)
    cell(make_cell, "dapo", "0", 3, .50)
    cell(make_cell, "dapo", "0", 9, .99)
    return discover_cells(make_cell.runs)


PAIRS = (("a2tgpo", "grpo"), ("a2tgpo", "igpo"), ("a2tgpo", "dapo"))


def test_paired_differences_over_common_seeds(make_cell, tmp_path):
    cfg = ReportConfig(paired=PAIRS, method_labels={"a2tgpo": "A²TGPO"})
    write_tables(cfg, paired_grid(make_cell), tmp_path)
    md = (tmp_path / "paired.md").read_text()
    lines = md.splitlines()
    assert "| Difference | Seeds | HotpotQA | Multi Avg |" in lines
    assert "| A²TGPO − GRPO | 3 | 6.0 ± 4.3† | 6.0 ± 4.3† |" in lines
    assert "| A²TGPO − IGPO | 3 | 4.0 ± 6.6 | 4.0 ± 6.6 |" in lines
    assert "| A²TGPO − DAPO | 1 | 2.0 | 2.0 |" in lines
    assert "† marks a difference whose interval excludes 0" in md
    assert "A difference over one common seed is printed without an interval" in md
    assert "Bold" not in md and "**" not in md  # no "best" among differences
    tex = (tmp_path / "paired.tex").read_text()
    assert (r"Qwen3-4B & A²TGPO \ensuremath{-} GRPO & 3 & 6.0 $\pm$ 4.3$^\dagger$ & "
            r"6.0 $\pm$ 4.3$^\dagger$ \\") in tex
    assert r" & A²TGPO \ensuremath{-} IGPO & 3 & 4.0 $\pm$ 6.6 & 4.0 $\pm$ 6.6 \\" in tex
    assert r"\ensuremath{\dagger} marks a difference" in tex


def test_paired_csv(make_cell, tmp_path):
    write_tables(ReportConfig(paired=PAIRS), paired_grid(make_cell), tmp_path)
    df = pd.read_csv(tmp_path / "paired.csv", dtype={"seeds": str})
    assert list(df.columns) == list(CSV_COLUMNS)
    rows = df[df.column == "hotpotqa"].set_index("row")
    assert list(rows.index) == ["a2tgpo-grpo", "a2tgpo-igpo", "a2tgpo-dapo"]
    grpo, igpo, dapo = (rows.loc[f"a2tgpo-{m}"] for m in ("grpo", "igpo", "dapo"))
    assert (grpo["mean"], grpo["std"], grpo["ci95"]) == pytest.approx(
        (6.0, math.sqrt(3), 4.302653), abs=1e-6)
    assert grpo.n_seeds == 3 and grpo.seeds == "1;2;3" and grpo.excludes_zero is True
    assert (igpo["mean"], igpo["std"], igpo["ci95"]) == pytest.approx(
        (4.0, math.sqrt(7), 6.572411), abs=1e-6)
    assert igpo.excludes_zero is False
    assert dapo["mean"] == pytest.approx(2.0) and dapo.seeds == "3" and dapo.n_seeds == 1
    assert pd.isna(dapo["ci95"]) and pd.isna(dapo["excludes_zero"])
    assert grpo.row_label == "A2TGPO − GRPO" and not df.best.any()


def test_paired_table_shows_the_interval_in_std_mode_too(make_cell, tmp_path):
    # the † is about the interval, so the differences keep it (s = √3 = 1.7 is not shown)
    cfg = ReportConfig(spread="std", paired=PAIRS[:1])
    cells = paired_grid(make_cell)
    (row,) = build_tables(cfg, cells)["paired"].sections[0].rows
    assert row.stats["hotpotqa"].excludes_zero is True
    write_tables(cfg, cells, tmp_path)
    md = (tmp_path / "paired.md").read_text()
    assert "| A2TGPO − GRPO | 3 | 6.0 ± 4.3† | 6.0 ± 4.3† |" in md
    assert "whatever report.spread" in md


def test_paired_table_without_common_seeds_says_so(make_cell, tmp_path):
    # a2tgpo has seed 0 only, grpo seed 1 only, igpo no cell: no pair has a common seed
    cell(make_cell, "a2tgpo", "0.3", 0, .5)
    cell(make_cell, "grpo", "0", 1, .4)
    write_tables(ReportConfig(), discover_cells(make_cell.runs), tmp_path)
    md = (tmp_path / "paired.md").read_text()
    assert ("No results for this table: no pair of methods (a2tgpo − grpo, a2tgpo − igpo) has "
            "a seed evaluated (eval/summary.json) for both.") in md
    assert r"\emph{No results for this table" in (tmp_path / "paired.tex").read_text()
    empty = pd.read_csv(tmp_path / "paired.csv")
    assert list(empty.columns) == list(CSV_COLUMNS) and len(empty) == 0


def test_paired_option_is_checked(tmp_path):
    cfg = tmp_path / "study.yaml"
    cfg.write_text("report:\n  paired: [[a2tgpo, grpo], [a2tgpo]]\n")
    with pytest.raises(ConfigError, match=r"paired: each entry must be two different method "
                                          r"ids, got \[\['a2tgpo'\]\]"):
        load_report_config(cfg, "report")
    cfg.write_text("report:\n  paired: [[a2tgpo, igpo]]\n  spread: sem\n")
    with pytest.raises(ConfigError, match=r"report.spread: expected one of 'ci95', 'std'"):
        load_report_config(cfg, "report")
