"""The papers' tables from the cells' eval/summary.json files (`a2tgpo tables`).

Written to the output directory, each as `<name>.md`, `<name>.tex` and `<name>.csv`:

- `main`: methods (`report.methods`) x test datasets and group averages, one block per backbone
  (A2TGPO Table 1, with AT2PO from its Table 1).
- `ablation_a2tgpo`: IGPO -> + turn-group norm -> + D_t/√n rescaling -> + adaptive clip
  (A2TGPO Tables 2 and 4, multi-hop and single-hop columns side by side).
- `ablation_at2po`: random tree + GRPO loss -> + ATPO loss -> + entropy expansion -> + turn
  credit (AT2PO Table 2).
- `credit_at2po`: AT2PO's credit-assignment schemes (AT2PO Table 3).
- `beta`: the β method (`report.beta_method`) at every β it was run with (A2TGPO Figure 9).
- `paired`: is a difference between two methods real? For each pair (A, B) of
  `report.paired`, one row "A − B" per backbone block: the mean over seeds of the per-seed
  difference A − B, seeds matched by value (only seeds both methods have count), each method
  represented by its cells of the main table; ± the half-width of the paired 95% t-interval of
  those differences. † marks a difference whose interval excludes 0 (a paired two-sided t-test
  rejects "no difference" at the 5% level); one common seed gives the difference alone,
  unmarked.

Numbers are the metric (`report.metric`) x 100. Group averages come from the summaries'
`groups` (already sample-weighted over the group's test samples, as in the papers). A row with
several seeds shows the mean over seeds ± the half-width of the two-sided 95% Student-t
confidence interval of the mean, t_{0.975, n−1} · s / √n (`report.spread: ci95`, the default),
or ± s (`report.spread: std`), s the sample standard deviation (n − 1 denominator); its `Seeds`
column gives n. Bold marks the best printed value of each column within a backbone block
(not in the paired table); ties (equal printed values) are all bold; a column with one value
has no bold. Every table's caption says how the evaluated checkpoints were selected, read from
the cells.

CSV layout (tidy: one line per printed number, loads with `pandas.read_csv`):
`table, backbone, backbone_label, row, row_label, column, column_label, column_kind
(dataset|group), group, metric, mean, std, ci95, n_seeds, seeds, best, excludes_zero,
selection`, where `mean`, `std` (s) and `ci95` (the t-interval's half-width) are percentages
(10 decimals; `std` and `ci95` empty for one seed) whatever `report.spread` prints, `seeds` the
seed values joined by ";", `best` True where the printed number is bold, `excludes_zero` (paired
table only, else empty) True where the difference's interval excludes 0 (the † mark), and
`selection` the checkpoint selection of the cells behind the number. `row` holds method ids, β
values in the beta table, written as cell paths write them (read it with `dtype={"row": str}`),
and `A-B` in the paired table, where `mean`, `std`, `ci95` are those of the differences and
`seeds` the common seeds.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from scipy import stats

from a2tgpo.config import format_value
from a2tgpo.io import atomic_write_text
from a2tgpo.report import Cell, ReportConfig, by_method, pick_cells, selection_label

log = logging.getLogger(__name__)

TABLE_NAMES = ("main", "ablation_a2tgpo", "ablation_at2po", "credit_at2po", "beta", "paired")
FORMATS = ("md", "tex", "csv")
CSV_COLUMNS = ("table", "backbone", "backbone_label", "row", "row_label", "column",
               "column_label", "column_kind", "group", "metric", "mean", "std", "ci95",
               "n_seeds", "seeds", "best", "excludes_zero", "selection")


@dataclass(frozen=True)
class Column:
    id: str  # dataset name, or group name for an average column
    label: str
    kind: str  # "dataset" | "group"
    group: str


def t_half_width(values: list[float]) -> float | None:
    """Half-width of the two-sided 95% Student-t confidence interval of the mean of `values`:
    t_{0.975, n−1} · s / √n (s with n − 1 denominator); None below two values."""
    n = len(values)
    if n < 2:
        return None
    return float(stats.t.ppf(0.975, n - 1)) * statistics.stdev(values) / math.sqrt(n)


@dataclass
class Stat:
    """One printed number: the metric x 100 over the seeds that have it, or in the paired
    table (`difference`) the per-seed differences A − B over the seeds both have."""

    values: list[float]
    seeds: list[str]
    selection: list[str]
    best: bool = False
    difference: bool = False

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float | None:
        return statistics.stdev(self.values) if len(self.values) > 1 else None

    @property
    def ci95(self) -> float | None:
        return t_half_width(self.values)

    @property
    def excludes_zero(self) -> bool | None:
        """A difference's 95% interval excludes 0 (None: not a difference, or one seed)."""
        if not self.difference or self.ci95 is None:
            return None
        return abs(self.mean) > self.ci95


@dataclass
class Row:
    id: str
    label: str
    cells: list[Cell]  # in the paired table, both methods' cells of the common seeds
    stats: dict[str, Stat] = field(default_factory=dict)
    pairs: list[tuple[Cell, Cell]] = field(default_factory=list)  # paired table: (A, B) by seed

    @property
    def n_seeds(self) -> int:
        return len({c.seed for c in self.cells})


@dataclass
class Section:
    backbone: str
    label: str
    rows: list[Row]


@dataclass
class Table:
    name: str
    title: str
    caption: str
    columns: list[Column]
    sections: list[Section]
    empty_message: str = ""
    row_head: str = "Method"


# --------------------------------------------------------------------------------------------
# building


def _columns(cfg: ReportConfig, cells: list[Cell]) -> list[Column]:
    """Dataset columns grouped per `cfg.groups`, each group closed by its average column."""
    dataset_group: dict[str, str] = {}
    groups_present: set[str] = set()
    for c in cells:
        s = c.summary()
        for name, entry in s["datasets"].items():
            dataset_group.setdefault(name, str(entry.get("group") or "other"))
        groups_present.update(s["groups"])

    def order(name: str) -> tuple:
        base, _ = cfg.dataset_key(name)
        return ((cfg.datasets.index(base), name) if base in cfg.datasets
                else (len(cfg.datasets), name))

    cols: list[Column] = []
    group_order = list(cfg.groups) + sorted(set(dataset_group.values()) - set(cfg.groups))
    for g in group_order:
        for name in sorted((d for d, dg in dataset_group.items() if dg == g), key=order):
            cols.append(Column(name, cfg.dataset_label(name), "dataset", g))
        if g in cfg.groups and g in groups_present:
            cols.append(Column(g, cfg.group_label(g), "group", g))
    if cfg.show_all_average and "all" in groups_present:
        cols.append(Column("all", cfg.group_label("all"), "group", "all"))
    return cols


def _value(cfg: ReportConfig, cell: Cell, col: Column) -> float | None:
    """The cell's metric x 100 in column `col`; None where its summary lacks it."""
    entry = cell.summary()["datasets" if col.kind == "dataset" else "groups"].get(col.id)
    v = None if entry is None else entry.get(cfg.metric)
    return None if v is None else 100.0 * float(v)


def _fill(cfg: ReportConfig, row: Row, columns: list[Column]) -> None:
    for col in columns:
        values, seeds, sel = [], [], []
        for c in row.cells:
            v = _value(cfg, c, col)
            if v is None:
                continue
            values.append(v)
            seeds.append(str(c.seed))
            sel.append(selection_label(cfg, c.summary()))
        if values:
            row.stats[col.id] = Stat(values, seeds, sel)


def _mark_best(cfg: ReportConfig, section: Section, columns: list[Column]) -> None:
    for col in columns:
        stats = [r.stats[col.id] for r in section.rows if col.id in r.stats]
        if len(stats) < 2:
            continue
        # compare what is printed, so equal printed values are all bold
        printed = [round(s.mean, cfg.decimals) for s in stats]
        top = max(printed)
        for s, p in zip(stats, printed, strict=True):
            s.best = p == top


def _selection_text(cfg: ReportConfig, cells: list[Cell]) -> str:
    per_cell = Counter(selection_label(cfg, c.summary()) for c in cells)
    if not per_cell:
        return "Checkpoint selection: none evaluated."
    if len(per_cell) == 1:
        return f"Checkpoint selection: {next(iter(per_cell))}."
    parts = ", ".join(f"{lab} ({n} cell{'s' if n != 1 else ''})"
                      for lab, n in sorted(per_cell.items()))
    return f"Checkpoint selection: mixed protocols: {parts}."


def _seeds_text(cfg: ReportConfig, rows: list[Row]) -> str:
    if not any(r.n_seeds > 1 for r in rows):
        return "One seed per row."
    spread = ("the half-width of the two-sided 95% Student-t confidence interval of the mean "
              "(t_{0.975, n − 1} · s / √n, s the sample standard deviation with n − 1 "
              "denominator)" if cfg.spread == "ci95"
              else "sample standard deviation (n − 1 denominator)")
    return f"Rows with several seeds show mean ± {spread} over seeds; Seeds gives their number n."


def _caption(cfg: ReportConfig, what: str, rows: list[Row]) -> str:
    metric = cfg.metric.upper()
    lead = f"{what} " if what else ""
    cells = [c for r in rows for c in r.cells]
    return (f"{lead}{metric} (%) on the test sets; Avg columns are sample-weighted averages "
            f"over the group's test samples. {_seeds_text(cfg, rows)} Bold: the best printed "
            f"value of each column within a backbone (ties all bold). "
            f"{_selection_text(cfg, cells)}")


def _evaluated(cells: list[Cell]) -> list[Cell]:
    done = [c for c in cells if c.summary() is not None]
    if len(done) < len(cells):
        log.info("%d of %d cells have no %s yet; left out of the tables",
                 len(cells) - len(done), len(cells), "eval/summary.json")
    return done


def _method_table(cfg: ReportConfig, cells: list[Cell], name: str, title: str, what: str,
                  rows_spec: dict[str, str]) -> Table:
    """A table whose rows are methods (`rows_spec`: id -> label), one block per backbone."""
    grouped = by_method(cells)
    sections, missing = [], {}
    for b in cfg.order_backbones(c.backbone for c in cells):
        rows = []
        for method, label in rows_spec.items():
            seeds = pick_cells(cfg, grouped.get((b, method), {}), method, f"{name} [{b}]")
            if seeds:
                rows.append(Row(method, label, seeds))
            else:
                missing.setdefault(b, []).append(method)
        if rows:
            sections.append(Section(b, cfg.backbone_label(b), rows))
    for b, methods in missing.items():
        if sections:  # an empty table says so once, in write_tables
            log.info("%s [%s]: no evaluated cells of %s; rows left out", name, b,
                     ", ".join(methods))
    used = [c for s in sections for r in s.rows for c in r.cells]
    empty = "" if sections else (
        f"No results for this table: none of its methods ({', '.join(rows_spec) or 'none'}) "
        "has an evaluated cell (eval/summary.json).")
    return _finish(cfg, Table(name, title, "", _columns(cfg, used), sections, empty), what)


def _beta_table(cfg: ReportConfig, cells: list[Cell]) -> Table:
    grouped = by_method(cells)
    sections = []
    for b in cfg.order_backbones(c.backbone for c in cells):
        betas = grouped.get((b, cfg.beta_method), {})
        rows = [Row(format_value(beta), f"β = {format_value(beta)}", seeds)
                for beta, seeds in sorted(betas.items())]
        if rows:
            sections.append(Section(b, cfg.backbone_label(b), rows))
    used = [c for s in sections for r in s.rows for c in r.cells]
    label = cfg.method_label(cfg.beta_method)
    empty = "" if sections else (
        f"No results for this table: no evaluated cell of {cfg.beta_method} at any β.")
    title = f"Sensitivity of {label} to the adaptive-clip strength β"
    return _finish(cfg, Table("beta", title, "", _columns(cfg, used), sections, empty, "β"),
                   f"{label} at each β (c = 1 + β(2σ(îg) − 1); β = 0 is a fixed clip):")


def _paired_table(cfg: ReportConfig, cells: list[Cell]) -> Table:
    """Per backbone, one row "A − B" per pair of `cfg.paired`: per-seed differences over the
    seeds both methods have, each method at the β its main-table row shows."""
    grouped = by_method(cells)
    sections = []
    for b in cfg.order_backbones(c.backbone for c in cells):
        rows = []
        for a, ref in cfg.paired:
            # the main table's cells, so that the differences are those of its numbers
            picked = [{c.seed: c for c in pick_cells(cfg, grouped.get((b, m), {}), m,
                                                      f"paired [{b}]")} for m in (a, ref)]
            common = sorted(picked[0].keys() & picked[1].keys())
            if not common:
                log.info("paired [%s]: %s and %s have no evaluated seed in common; row left "
                         "out", b, a, ref)
                continue
            pairs = [(picked[0][s], picked[1][s]) for s in common]
            rows.append(Row(f"{a}-{ref}", f"{cfg.method_label(a)} − {cfg.method_label(ref)}",
                            [c for pair in pairs for c in pair], pairs=pairs))
        if rows:
            sections.append(Section(b, cfg.backbone_label(b), rows))
    # a method's cells can serve several pairs: each counts once
    used = list({c.run_dir: c for s in sections for r in s.rows for c in r.cells}.values())
    table = Table("paired", "Paired differences between methods", "", _columns(cfg, used),
                  sections, row_head="Difference")
    for s in sections:
        for r in s.rows:
            _fill_paired(cfg, r, table.columns)
    if not sections:
        listed = ", ".join(f"{a} − {ref}" for a, ref in cfg.paired) or "none"
        table.empty_message = (f"No results for this table: no pair of methods ({listed}) has a "
                               "seed evaluated (eval/summary.json) for both.")
        table.caption = table.empty_message
        return table
    numbers = [st for s in sections for r in s.rows for st in r.stats.values()]
    single = (" A difference over one common seed is printed without an interval and is not "
              "marked." if any(st.ci95 is None for st in numbers) else "")
    table.caption = (
        f"A − B: mean over seeds of the per-seed difference of {cfg.metric.upper()} (%) on the "
        "test sets, seeds matched by value (only seeds both methods have count; Seeds gives "
        "their number n), each method represented by its cells of the main table; ± the "
        "half-width of the paired two-sided 95% Student-t confidence interval of the mean "
        "difference (t_{0.975, n − 1} · s / √n, s the sample standard deviation of the n "
        "differences), whatever report.spread. † marks a difference whose interval excludes 0 "
        f"(a paired two-sided t-test at the 5% level).{single} {_selection_text(cfg, used)}")
    return table


def _fill_paired(cfg: ReportConfig, row: Row, columns: list[Column]) -> None:
    for col in columns:
        values, seeds, sel = [], [], []
        for a, b in row.pairs:
            va, vb = _value(cfg, a, col), _value(cfg, b, col)
            if va is None or vb is None:
                continue
            values.append(va - vb)
            seeds.append(str(a.seed))
            sel += [selection_label(cfg, a.summary()), selection_label(cfg, b.summary())]
        if values:
            row.stats[col.id] = Stat(values, seeds, sel, difference=True)


def _finish(cfg: ReportConfig, table: Table, what: str) -> Table:
    for s in table.sections:
        for r in s.rows:
            _fill(cfg, r, table.columns)
        _mark_best(cfg, s, table.columns)
    rows = [r for s in table.sections for r in s.rows]
    table.caption = (_caption(cfg, what, rows) if rows
                     else f"{what}{' ' if what else ''}{table.empty_message}")
    return table


def build_tables(cfg: ReportConfig, cells: list[Cell]) -> dict[str, Table]:
    """Every table of TABLE_NAMES from the evaluated cells among `cells`."""
    cells = _evaluated(cells)
    listed = (set(cfg.methods) | set(cfg.ablation_a2tgpo) | set(cfg.ablation_at2po)
              | set(cfg.credit_at2po) | {cfg.beta_method})
    for m in sorted({c.method for c in cells} - listed):
        log.info("cells of method %s are in no table (add it to report.methods to show it)", m)
    main_rows = {m: cfg.method_label(m) for m in cfg.methods}
    return {
        "main": _method_table(cfg, cells, "main", "Main results", "", main_rows),
        "ablation_a2tgpo": _method_table(
            cfg, cells, "ablation_a2tgpo", "A2TGPO additive ablation",
            "A2TGPO additive ablation (each row adds one component to the row above):",
            dict(cfg.ablation_a2tgpo)),
        "ablation_at2po": _method_table(
            cfg, cells, "ablation_at2po", "AT2PO additive ablation",
            "AT2PO additive ablation (each row adds one component to the row above):",
            dict(cfg.ablation_at2po)),
        "credit_at2po": _method_table(
            cfg, cells, "credit_at2po", "AT2PO turn-wise credit-assignment schemes",
            "AT2PO with each turn-credit scheme (node-value aggregation and advantage form):",
            dict(cfg.credit_at2po)),
        "beta": _beta_table(cfg, cells),
        "paired": _paired_table(cfg, cells),
    }


# --------------------------------------------------------------------------------------------
# rendering


def _number(cfg: ReportConfig, s: Stat, pm: str) -> str:
    # a difference always shows its interval: whether it excludes 0 is the paired table's point
    spread = s.ci95 if s.difference or cfg.spread == "ci95" else s.std
    text = f"{s.mean:.{cfg.decimals}f}"
    if spread is not None:
        text += f"{pm}{spread:.{cfg.decimals}f}"
    return text


_MD_SPECIAL = {"\\": "\\\\", "|": "\\|", "*": "\\*", "_": "\\_", "`": "\\`"}


def md_escape(text: str) -> str:
    return "".join(_MD_SPECIAL.get(ch, ch) for ch in text)


_TEX_SPECIAL = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
    "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
    "<": r"\textless{}", ">": r"\textgreater{}",
    # symbols our labels use, as math so that plain pdflatex typesets them
    "√": r"\ensuremath{\surd}", "β": r"\ensuremath{\beta}", "γ": r"\ensuremath{\gamma}",
    "σ": r"\ensuremath{\sigma}", "±": r"\ensuremath{\pm}", "−": r"\ensuremath{-}",
    "×": r"\ensuremath{\times}", "→": r"\ensuremath{\rightarrow}", "≥": r"\ensuremath{\geq}",
    "≤": r"\ensuremath{\leq}", "î": r"\^{\i}", "·": r"\ensuremath{\cdot}",
    "†": r"\ensuremath{\dagger}",
}


def tex_escape(text: str) -> str:
    """Plain text -> LaTeX source that prints it (specials escaped, a few symbols as math)."""
    return "".join(_TEX_SPECIAL.get(ch, ch) for ch in text)


def render_markdown(cfg: ReportConfig, table: Table) -> str:
    out = [f"# {md_escape(table.title)}", "", md_escape(table.caption), ""]
    if not table.sections:  # the caption says why
        return "\n".join(out)
    head = [table.row_head, "Seeds"] + [c.label for c in table.columns]
    for s in table.sections:
        out += [f"## {md_escape(s.label)}", "",
                "| " + " | ".join(md_escape(h) for h in head) + " |",
                "|" + "---|" + "---:|" * (len(head) - 1)]
        for r in s.rows:
            cells = [md_escape(r.label), str(r.n_seeds)]
            cells += _stat_cells(cfg, table, r, missing="–", pm=" ± ", bold="**{}**",
                                 dagger="{}†")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _stat_cells(cfg: ReportConfig, table: Table, row, *, missing: str, pm: str, bold: str,
                dagger: str) -> list[str]:
    """A row's value per column: mean (± spread), `bold` formatting the column's best,
    `dagger` a difference whose interval excludes 0, `missing` where the row has no value."""
    cells = []
    for col in table.columns:
        st = row.stats.get(col.id)
        if st is None:
            cells.append(missing)
            continue
        text = _number(cfg, st, pm)
        text = bold.format(text) if st.best else text
        cells.append(dagger.format(text) if st.excludes_zero else text)
    return cells


def render_latex(cfg: ReportConfig, table: Table) -> str:
    """A booktabs `table` float (needs \\usepackage{booktabs})."""
    out = ["% generated by `a2tgpo tables`; needs \\usepackage{booktabs}",
           "\\begin{table}[t]", "\\centering",
           f"\\caption{{{tex_escape(table.title)}. {tex_escape(table.caption)}}}",
           f"\\label{{tab:{table.name.replace('_', '-')}}}"]
    if not table.sections:
        out += [f"\\emph{{{tex_escape(table.empty_message)}}}", "\\end{table}", ""]
        return "\n".join(out)
    head = ["Backbone", table.row_head, "Seeds"]
    head += [c.label for c in table.columns]
    out += ["\\begin{tabular}{ll" + "r" * (len(head) - 2) + "}", "\\toprule",
            " & ".join(tex_escape(h) for h in head) + " \\\\"]
    for s in table.sections:
        out.append("\\midrule")
        for i, r in enumerate(s.rows):
            cells = [tex_escape(s.label) if i == 0 else "", tex_escape(r.label),
                     str(r.n_seeds)]
            cells += _stat_cells(cfg, table, r, missing="--", pm=" $\\pm$ ",
                                 bold="\\textbf{{{}}}", dagger="{}$^\\dagger$")
            out.append(" & ".join(cells) + " \\\\")
    out += ["\\bottomrule", "\\end{tabular}", "\\end{table}", ""]
    return "\n".join(out)


def render_csv(cfg: ReportConfig, table: Table) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for s in table.sections:
        for r in s.rows:
            for col in table.columns:
                st = r.stats.get(col.id)
                if st is None:
                    continue
                sel = sorted(set(st.selection))
                w.writerow([table.name, s.backbone, s.label, r.id, r.label, col.id, col.label,
                            col.kind, col.group, cfg.metric, _full(st.mean),
                            "" if st.std is None else _full(st.std),
                            "" if st.ci95 is None else _full(st.ci95), len(st.values),
                            ";".join(st.seeds), st.best,
                            "" if st.excludes_zero is None else st.excludes_zero,
                            "; ".join(sel)])
    return buf.getvalue()


def _full(x: float) -> str:
    # full precision without binary noise (56.99999999999999 -> 57.0)
    return repr(round(x, 10))


def write_tables(cfg: ReportConfig, cells: list[Cell], out_dir: str | Path) -> list[Path]:
    """Build every table and write its .md/.tex/.csv atomically; returns the paths."""
    out_dir = Path(out_dir)
    written = []
    renderers = {"md": render_markdown, "tex": render_latex, "csv": render_csv}
    for name, table in build_tables(cfg, cells).items():
        if not table.sections:
            log.info("%s: %s", name, table.empty_message)
        for ext in FORMATS:
            path = out_dir / f"{name}.{ext}"
            atomic_write_text(path, renderers[ext](cfg, table))
            written.append(path)
    return written


def main(config: str | Path | None, section: str | None, runs: str | Path | None,
         cells: list[str] | None, out: str | Path) -> int:
    from a2tgpo.report import discover_cells, load_report_config, merge_tracks

    cfg = load_report_config(config, section)
    found = merge_tracks(discover_cells(runs, cells))
    for path in write_tables(cfg, found, out):
        print(path)
    return 0

