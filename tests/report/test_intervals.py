"""Spread over seeds (95% t-interval or std): numbers worked out by hand.

Quantiles used below: t_{0.975,1} = 12.706205, t_{0.975,2} = 4.302653 (the normal quantile
1.96 would give much narrower intervals at these seed counts, which is what the tests catch).
"""

import math

import pandas as pd
import pytest

from a2tgpo.config import ConfigError
from a2tgpo.report import ReportConfig, discover_cells, load_report_config
from a2tgpo.report.tables import CSV_COLUMNS, t_half_width, write_tables

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
    igpo = df[(df.row == "igpo") & (df.column == "hotpotqa")].iloc[0]
    assert pd.isna(igpo["std"]) and pd.isna(igpo["ci95"])  # one seed


def test_spread_option_is_checked(tmp_path):
    cfg = tmp_path / "study.yaml"
    cfg.write_text("report:\n  spread: sem\n")
    with pytest.raises(ConfigError, match=r"report.spread: expected one of 'ci95', 'std'"):
        load_report_config(cfg, "report")
