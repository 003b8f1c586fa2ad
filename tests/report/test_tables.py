"""Tables from synthetic cells: values, seeds, bold, ties, missing cells, escaping, CSV."""

import dataclasses
import json
import logging

import pandas as pd
import pytest

from a2tgpo.cell import Cell, load_summary
from a2tgpo.cli import main as cli_main
from a2tgpo.report import ReportConfig, ReportInputError, discover_cells
from a2tgpo.report.tables import (
    CSV_COLUMNS,
    build_tables,
    md_escape,
    render_latex,
    tex_escape,
    write_tables,
)

M, S = "multi_hop", "single_hop"


def grid(make_cell):
    """Three methods on qwen3-4b, datasets hotpotqa (multi) and nq (single).

    EM fractions per seed -> printed mean ± sample std (×100, one decimal; `spread: std`):
      grpo   seeds 0,1,2  hotpotqa .40 .42 .44 -> 42.0 ± 2.0  (sqrt((4+0+4)/2) = 2)
                          nq       .50 .50 .50 -> 50.0 ± 0.0
                          multi    .30 .33 .36 -> 33.0 ± 3.0
                          single   .60 .60 .60 -> 60.0 ± 0.0
      igpo   seed 0       hotpotqa .46 -> 46.0; nq .48 -> 48.0; multi .37; single .70
      a2tgpo β 0.3 seeds 0,1
                          hotpotqa .45 .47 -> 46.0 ± 1.4  (sqrt(2) = 1.414)
                          nq       .49 .51 -> 50.0 ± 1.4
                          multi    .38 .40 -> 39.0 ± 1.4
                          single   .61 .63 -> 62.0 ± 1.4
    Bold per column: hotpotqa 46.0 igpo and a2tgpo (tie); nq 50.0 grpo and a2tgpo (tie);
    Multi Avg 39.0 a2tgpo; Single Avg 70.0 igpo.
    a2tgpo also runs at β 0 and β 0.1 (one seed each) for the β table only.
    """
    def cell(method, beta, seed, hot, nq, multi, single, **kw):
        make_cell("qwen3-4b", method, beta, seed, datasets={"hotpotqa": (hot, M), "nq": (nq, S)},
                  groups={M: multi, S: single, "all": (multi + single) / 2}, **kw)

    for seed, (h, m) in enumerate([(.40, .30), (.42, .33), (.44, .36)]):
        cell("grpo", "0", seed, h, .50, m, .60)
    cell("igpo", "0", 0, .46, .48, .37, .70)
    cell("a2tgpo", "0.3", 0, .45, .49, .38, .61)
    cell("a2tgpo", "0.3", 1, .47, .51, .40, .63)
    cell("a2tgpo", "0", 0, .40, .50, .34, .57)
    cell("a2tgpo", "0.1", 0, .41, .52, .35, .58)
    return make_cell.runs


def test_main_table_markdown_means_stds_and_bold(make_cell, tmp_path):
    runs = grid(make_cell)
    written = write_tables(ReportConfig(spread="std"), discover_cells(runs), tmp_path / "tables")
    names = sorted(p.name for p in written)
    assert names == sorted(f"{t}.{e}" for t in ("main", "ablation_a2tgpo", "ablation_at2po",
                                                 "credit_at2po", "beta", "paired")
                           for e in ("md", "tex", "csv"))
    md = (tmp_path / "tables" / "main.md").read_text()
    lines = md.splitlines()
    assert "## Qwen3-4B" in lines
    assert "| Method | Seeds | HotpotQA | Multi Avg | NQ | Single Avg |" in lines
    assert "| GRPO | 3 | 42.0 ± 2.0 | 33.0 ± 3.0 | **50.0 ± 0.0** | 60.0 ± 0.0 |" in lines
    assert "| IGPO | 1 | **46.0** | 37.0 | 48.0 | **70.0** |" in lines
    assert ("| A2TGPO | 2 | **46.0 ± 1.4** | **39.0 ± 1.4** | **50.0 ± 1.4** | 62.0 ± 1.4 |"
            in lines)
    # rows in the configured order; methods without cells (react, dapo, ...) left out
    rows = [ln.split(" | ")[0] for ln in lines if ln.startswith("| ") and "Seeds" not in ln]
    assert rows == ["| GRPO", "| IGPO", "| A2TGPO"]
    assert "mean ± sample standard deviation (n − 1" in md
    assert "Checkpoint selection: dev-selected." in md


def test_beta_table_rows_sorted_numerically(make_cell, tmp_path):
    runs = grid(make_cell)
    write_tables(ReportConfig(spread="std"), discover_cells(runs), tmp_path)
    lines = (tmp_path / "beta.md").read_text().splitlines()
    # β rows: 0 -> .40/.34/.50/.57, 0.1 -> .41/.35/.52/.58, 0.3 -> the two seeds above
    assert lines[lines.index("| β | Seeds | HotpotQA | Multi Avg | NQ | Single Avg |") + 2:][:3] \
        == ["| β = 0 | 1 | 40.0 | 34.0 | 50.0 | 57.0 |",
            "| β = 0.1 | 1 | 41.0 | 35.0 | **52.0** | 58.0 |",
            "| β = 0.3 | 2 | **46.0 ± 1.4** | **39.0 ± 1.4** | 50.0 ± 1.4 | **62.0 ± 1.4** |"]
    tex = (tmp_path / "beta.tex").read_text()
    assert r"\ensuremath{\beta} = 0.1 & 1 & 41.0 & 35.0 & \textbf{52.0} & 58.0 \\" in tex


def test_ablation_rows_labels_and_latex_escaping(make_cell, tmp_path):
    # the A2TGPO ablation: igpo .46 and a2tgpo_tgn_sqrt .47 on hotpotqa (one seed each);
    # a2tgpo_tgn and a2tgpo have no cells -> their rows are left out
    make_cell("qwen3-4b", "igpo", "0", 0, datasets={"hotpotqa": (.46, M)}, groups={M: .46})
    make_cell("qwen3-4b", "a2tgpo_tgn_sqrt", "0", 0, datasets={"hotpotqa": (.47, M)},
              groups={M: .47})
    write_tables(ReportConfig(), discover_cells(make_cell.runs), tmp_path)
    md = (tmp_path / "ablation_a2tgpo.md").read_text()
    assert "| IGPO | 1 | 46.0 | 46.0 |" in md
    assert r"| + D\_t/√n rescaling | 1 | **47.0** | **47.0** |" in md
    assert "turn-group norm" not in md
    tex = (tmp_path / "ablation_a2tgpo.tex").read_text()
    assert r" & + D\_t/\ensuremath{\surd}n rescaling & 1 & \textbf{47.0} & \textbf{47.0} \\" in tex
    assert r"Qwen3-4B & IGPO & 1 & 46.0 & 46.0 \\" in tex
    assert tex.count(r"\begin{tabular}{llrrr}") == 1 and r"\bottomrule" in tex


def test_escaping_functions():
    assert tex_escape("+ √n") == r"+ \ensuremath{\surd}n"
    assert tex_escape("a_b & 50% #1 {x} ~ ^ \\") == \
        r"a\_b \& 50\% \#1 \{x\} \textasciitilde{} \textasciicircum{} \textbackslash{}"
    assert tex_escape("A=V−V_root") == r"A=V\ensuremath{-}V\_root"
    assert md_escape("a_b|c*d") == r"a\_b\|c\*d"


def test_rounding_ties_follow_printed_decimals(make_cell, tmp_path):
    # .4604 and .4596 both print 46.0 at one decimal (tie: both bold); at two decimals
    # they print 46.04 and 45.96 and only the first is bold
    make_cell("qwen3-4b", "grpo", "0", 0, datasets={"hotpotqa": (.4604, M)}, groups={})
    make_cell("qwen3-4b", "dapo", "0", 0, datasets={"hotpotqa": (.4596, M)}, groups={})
    cells = discover_cells(make_cell.runs)
    one = build_tables(ReportConfig(), cells)["main"].sections[0].rows
    assert [r.stats["hotpotqa"].best for r in one] == [True, True]
    two = build_tables(ReportConfig(decimals=2), cells)["main"].sections[0].rows
    assert [r.id for r in two] == ["grpo", "dapo"]
    assert [r.stats["hotpotqa"].best for r in two] == [True, False]


def test_missing_cells_and_empty_tables_are_noted(make_cell, tmp_path, caplog):
    make_cell("qwen3-4b", "grpo", "0", 0, datasets={"hotpotqa": (.5, M)}, groups={M: .5})
    make_cell("qwen3-4b", "grpo", "0", 1, metrics=[{"step": 1, "train/reward": 0.1}])  # no eval
    make_cell("qwen3-4b", "mystery", "0", 0, datasets={"hotpotqa": (.1, M)}, groups={M: .1})
    with caplog.at_level(logging.INFO, logger="a2tgpo.report"):
        write_tables(ReportConfig(), discover_cells(make_cell.runs), tmp_path)
    assert "1 of 3 cells have no eval/summary.json yet" in caplog.text
    assert "cells of method mystery are in no table" in caplog.text
    assert "main [qwen3-4b]: no evaluated cells of react, dapo, gspo, tree_grpo, gigpo, igpo, " \
        "aepo, at2po, a2tgpo; rows left out" in caplog.text
    # one evaluated seed: no ± and the seed count is 1
    assert "| GRPO | 1 | 50.0 | 50.0 |" in (tmp_path / "main.md").read_text()
    md = (tmp_path / "ablation_at2po.md").read_text()
    assert "No results for this table: none of its methods (at2po\\_random\\_grpo" in md
    assert r"\emph{No results for this table" in (tmp_path / "ablation_at2po.tex").read_text()
    empty = pd.read_csv(tmp_path / "ablation_at2po.csv")
    assert list(empty.columns) == list(CSV_COLUMNS) and len(empty) == 0


def test_csv_round_trip_with_pandas(make_cell, tmp_path):
    runs = grid(make_cell)
    write_tables(ReportConfig(), discover_cells(runs), tmp_path)
    df = pd.read_csv(tmp_path / "main.csv", dtype={"seeds": str})
    assert list(df.columns) == list(CSV_COLUMNS)
    # 3 rows x 4 columns, one line per printed number
    assert len(df) == 12 and set(df.table) == {"main"} and set(df.metric) == {"em"}
    grpo = df[(df.row == "grpo") & (df.column == "hotpotqa")].iloc[0]
    assert grpo["mean"] == pytest.approx(42.0) and grpo["std"] == pytest.approx(2.0)
    assert grpo.n_seeds == 3 and grpo.seeds == "0;1;2" and not grpo.best
    assert grpo.column_kind == "dataset" and grpo.group == M and grpo.row_label == "GRPO"
    igpo = df[(df.row == "igpo") & (df.column == "hotpotqa")].iloc[0]
    assert pd.isna(igpo["std"]) and igpo.best  # one seed: no std
    avg = df[(df.row == "a2tgpo") & (df.column == M)].iloc[0]
    assert avg.column_kind == "group" and avg.column_label == "Multi Avg" and avg.best
    assert avg["mean"] == pytest.approx(39.0) and avg.selection == "dev-selected"
    # the wide view the printed table shows, rebuilt from the tidy file
    wide = df.pivot(index="row", columns="column", values="mean")
    assert wide.loc["igpo", "nq"] == pytest.approx(48.0)


def test_mixed_selection_protocols_are_stated(make_cell, tmp_path):
    make_cell("qwen3-4b", "grpo", "0", 0, datasets={"nq": (.5, S)}, groups={S: .5})
    make_cell("qwen3-4b", "dapo", "0", 0, datasets={"nq": (.6, S)}, groups={S: .6},
              criterion="test_avg", label="whatever")  # the configured wording wins
    make_cell("qwen3-4b", "gspo", "0", 0, datasets={"nq": (.7, S)}, groups={S: .7},
              criterion="custom", label="hand-picked")  # unknown criterion: its label
    write_tables(ReportConfig(), discover_cells(make_cell.runs), tmp_path)
    md = (tmp_path / "main.md").read_text()
    assert ("Checkpoint selection: mixed protocols: best test average (papers' protocol) "
            "(1 cell), dev-selected (1 cell), hand-picked (1 cell).") in md
    tex = (tmp_path / "main.tex").read_text()
    assert "best test average (papers' protocol) (1 cell)" in tex


def test_columns_order_toy_prefix_unknown_dataset_and_f1(make_cell, tmp_path):
    # toy_<set> is ordered and labelled like <set>; extra_set (unlisted) follows its group's
    # listed sets; the metric f1 reads the f1 fields (EM / 2 here)
    make_cell("toy", "grpo", "0", 0, datasets={
        "toy_nq": (.6, S), "extra_set": (.2, M), "toy_musique": (.4, M),
        "toy_hotpotqa": (.8, M)}, groups={M: .5, S: .6, "all": .55})
    cfg = ReportConfig(metric="f1", show_all_average=True)
    write_tables(cfg, discover_cells(make_cell.runs), tmp_path)
    md = (tmp_path / "main.md").read_text()
    assert "## toy" in md
    assert ("| Method | Seeds | toy HotpotQA | toy MuSiQue | extra\\_set | Multi Avg | toy NQ "
            "| Single Avg | All Avg |") in md
    assert "| GRPO | 1 | 40.0 | 20.0 | 10.0 | 25.0 | 30.0 | 30.0 | 27.5 |" in md
    assert "F1 (%)" in md


def test_backbone_blocks_in_configured_order(make_cell, tmp_path):
    for b in ("zeta", "qwen2.5-7b", "qwen3-4b"):
        make_cell(b, "grpo", "0", 0, datasets={"nq": (.5, S)}, groups={S: .5})
    table = build_tables(ReportConfig(), discover_cells(make_cell.runs))["main"]
    assert [s.label for s in table.sections] == ["Qwen3-4B", "Qwen2.5-7B", "zeta"]
    tex = render_latex(ReportConfig(), table)
    assert tex.count(r"\midrule") == 3


def test_main_table_picks_the_beta_cells(make_cell, caplog):
    # a2tgpo at β 0.3 is the main row (beta_main); grpo, run at β 0 and 0.5, shows β 0;
    # gspo run at 0.1 and 0.2 only has no β 0 cell and is left out with a note
    for m, beta, em in [("a2tgpo", "0.3", .5), ("a2tgpo", "0.5", .1), ("grpo", "0", .4),
                        ("grpo", "0.5", .2), ("gspo", "0.1", .3), ("gspo", "0.2", .3)]:
        make_cell("qwen3-4b", m, beta, 0, datasets={"nq": (em, S)}, groups={})
    with caplog.at_level(logging.INFO, logger="a2tgpo.report"):
        rows = build_tables(ReportConfig(), discover_cells(make_cell.runs))["main"] \
            .sections[0].rows
    assert {r.id: r.stats["nq"].mean for r in rows} == pytest.approx({"grpo": 40.0,
                                                                       "a2tgpo": 50.0})
    assert "gspo has cells at β 0.1, 0.2 but none at β 0" in caplog.text


def test_cells_from_explicit_list_and_bad_paths(make_cell, tmp_path):
    a = make_cell("qwen3-4b", "grpo", "0.0", 7, datasets={"nq": (.5, S)}, groups={S: .5})
    b = make_cell("qwen3-4b", "igpo", "0", 1, datasets={"nq": (.4, S)}, groups={S: .4})
    cells = discover_cells(cells=[str(a / "eval" / "summary.json"), str(b)])
    assert [(c.method, c.beta, c.seed, c.run_dir) for c in cells] == [("grpo", 0.0, 7, a),
                                                                      ("igpo", 0.0, 1, b)]
    with pytest.raises(ReportInputError, match=r"no beta~ component"):
        Cell.from_dir(tmp_path / "backbone~x" / "method~y" / "seed~0")
    with pytest.raises(FileNotFoundError, match="runs directory not found"):
        discover_cells(tmp_path / "nowhere")


def test_bad_summary_names_file_and_key(make_cell):
    cell = make_cell("qwen3-4b", "grpo", "0", 0, datasets={"nq": (47.0, S)}, groups={})
    with pytest.raises(ReportInputError, match=r"summary.json: datasets.nq.em: expected a "
                                               r"fraction in \[0, 1\], got 47.0"):
        load_summary(cell / "eval" / "summary.json")
    (cell / "eval" / "summary.json").write_text(json.dumps({"datasets": {}}))
    with pytest.raises(ReportInputError, match="groups: missing"):
        load_summary(cell / "eval" / "summary.json")


def test_cli_tables_with_config(make_cell, tmp_path, capsys):
    runs = grid(make_cell)
    cfg = tmp_path / "study.yaml"
    cfg.write_text("report:\n  decimals: 2\n  methods: [a2tgpo, grpo]\n"
                   "  method_labels: {a2tgpo: A²TGPO}\n")
    out = tmp_path / "tables"
    assert cli_main(["tables", "--runs", str(runs), "--config", str(cfg), "--section", "report",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert str(out / "main.md") in printed and len(printed) == 18
    md = (out / "main.md").read_text()
    # the default spread is the 95% t-interval's half-width t_{0.975, n-1} · s / √n:
    # A2TGPO .45/.47: s = √2, t_{0.975,1} = 12.7062 -> 12.7062 · √2 / √2 = 12.71;
    # GRPO .40/.42/.44: s = 2, t_{0.975,2} = 4.302653 -> 4.302653 · 2 / √3 = 4.968 -> 4.97.
    # GRPO keeps its built-in label
    assert "| A²TGPO | 2 | **46.00 ± 12.71** |" in md and "| GRPO | 3 | 42.00 ± 4.97 |" in md
    bad = tmp_path / "bad.yaml"
    bad.write_text("decimal: 2\n")
    assert cli_main(["tables", "--runs", str(runs), "--config", str(bad),
                     "--out", str(out)]) == 2
    assert "decimal: unknown key (did you mean 'decimals'?)" in capsys.readouterr().err


def test_method_labels_are_the_method_tables_names(monkeypatch):
    from a2tgpo.algo import methods

    cfg = ReportConfig()
    assert {m: cfg.method_label(m) for m in methods.METHODS} == \
        {m: c.name for m, c in methods.METHODS.items()}
    # read from the table, not a copy: a renamed method is shown by its new name
    renamed = dataclasses.replace(methods.METHODS["grpo"], name="Group RPO")
    monkeypatch.setitem(methods.METHODS, "grpo", renamed)
    assert cfg.method_label("grpo") == "Group RPO"
    # report.method_labels overrides; an id outside the table is shown as it is
    assert ReportConfig(method_labels={"grpo": "G"}).method_label("grpo") == "G"
    assert cfg.method_label("my_method") == "my_method"
