"""Tables and plots from the grid's result cells (the last stage of the DAG).

A *cell* (a2tgpo/cell.py) is one training run of the grid, a directory

    <runs>/backbone~<b>/method~<m>/beta~<beta>/seed~<s>/
    (<runs>/backbone~<b>/data~<track>/method~... in studies with training tracks)

holding `config.yaml`, `metrics.jsonl` (read only through `a2tgpo.tracking.read_metrics`),
`rollouts.jsonl`, `best.json` and `eval/summary.json`.

`ReportConfig` is the `report:` section of the study config: which methods form which table, in
what order and under which labels, the dataset columns, and the metric. Its defaults lay out the
papers' tables (A2TGPO Table 1, Tables 2/4, Figure 9; AT2PO Tables 2-3).

`a2tgpo.report.tables` writes the tables (`a2tgpo tables`), `a2tgpo.report.plots` the figures
(`a2tgpo plots`). This module holds what both share and imports neither matplotlib nor torch.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from a2tgpo.algo.methods import METHODS
from a2tgpo.cell import Cell, ReportInputError
from a2tgpo.config import format_value, option

log = logging.getLogger(__name__)

_BACKBONE_LABELS = {"qwen3-4b": "Qwen3-4B", "qwen3-8b": "Qwen3-8B", "qwen2.5-7b": "Qwen2.5-7B",
                    "qwen2.5-7b-instruct": "Qwen2.5-7B-Instruct", "toy": "toy"}
_DATASET_LABELS = {"hotpotqa": "HotpotQA", "2wikimultihopqa": "2Wiki", "musique": "MuSiQue",
                   "bamboogle": "Bamboogle", "nq": "NQ", "triviaqa": "TriviaQA",
                   "popqa": "PopQA"}
_GROUP_LABELS = {"multi_hop": "Multi Avg", "single_hop": "Single Avg", "all": "All Avg"}


@dataclass(frozen=True)
class ReportConfig:
    """Layout of the tables and plots (the `report:` section of the study config)."""

    metric: Literal["em", "f1"] = option(
        "em", "Metric of every table and of the β curve: em (exact match) or f1. Printed ×100.")
    decimals: int = option(1, "Decimals of the printed percentages (the papers print 2).", ge=0)
    backbones: tuple[str, ...] = option(
        ("qwen3-4b", "qwen3-8b", "qwen2.5-7b"),
        "Order of the backbone blocks; backbones in the results but not listed follow, sorted.")
    backbone_labels: dict[str, str] = option(
        doc="Display label per backbone id (ids not listed take the built-in label, else "
        "are shown as they are).",
        factory=lambda: dict(_BACKBONE_LABELS))
    methods: tuple[str, ...] = option(
        ("react", "grpo", "dapo", "gspo", "tree_grpo", "gigpo", "igpo", "aepo", "at2po",
         "a2tgpo"),
        "Rows of the main table (A2TGPO Table 1 order, with AT2PO from its Table 1 before "
        "A2TGPO), and the methods of the training-curve, tool-call and time plots.")
    method_labels: dict[str, str] = option(
        doc="Display label per method id (main table and plot legends); ids not listed show "
        "the method table's name (config/methods/<id>.yaml `name`), else the id.",
        factory=dict)
    datasets: tuple[str, ...] = option(
        ("hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "nq", "triviaqa", "popqa"),
        "Dataset column order within each group (Table 1). Datasets in the results but not "
        "listed follow their group's listed ones, sorted.")
    dataset_labels: dict[str, str] = option(
        doc="Column label per dataset name (names not listed take the built-in label, else "
        "are shown as they are).", factory=lambda: dict(_DATASET_LABELS))
    dataset_prefixes: dict[str, str] = option(
        doc="Name prefix -> label prefix: a dataset <prefix><name> is ordered and labelled like "
        "<name>, its label led by the label prefix (the toy world's sets are toy_<paper set>).",
        factory=lambda: {"toy_": "toy "})
    groups: tuple[str, ...] = option(
        ("multi_hop", "single_hop"),
        "Column groups in order: each group's datasets, then its sample-weighted average "
        "(eval/summary.json `groups`). Datasets of other groups follow, without an average.")
    group_labels: dict[str, str] = option(
        doc="Label of each group's average column.", factory=lambda: dict(_GROUP_LABELS))
    spread: Literal["ci95", "std"] = option(
        "ci95", "What follows ± in a row with several seeds: ci95 = the half-width of the "
        "two-sided 95% Student-t confidence interval of the mean over seeds, std = the sample "
        "standard deviation over seeds. The CSV files carry both.")
    show_all_average: bool = option(
        False, "Add the average over every test sample (group `all`) as a last column "
        "(the papers do not print it).")
    ablation_a2tgpo: dict[str, str] = option(
        doc="Rows (method id -> label) of the A2TGPO additive ablation (its Tables 2 and 4).",
        factory=lambda: {"igpo": "IGPO", "a2tgpo_tgn": "+ turn-group norm",
                         "a2tgpo_tgn_sqrt": "+ D_t/√n rescaling",
                         "a2tgpo": "+ adaptive clip (= A2TGPO)"})
    ablation_at2po: dict[str, str] = option(
        doc="Rows (method id -> label) of the AT2PO additive ablation (its Table 2).",
        factory=lambda: {"at2po_random_grpo": "random tree + GRPO loss",
                         "at2po_random_atpo": "+ ATPO loss",
                         "at2po_entropy_atpo": "+ entropy expansion",
                         "at2po": "+ turn credit (= AT2PO)"})
    credit_at2po: dict[str, str] = option(
        doc="Rows (method id -> label) of the AT2PO credit-assignment schemes (its Table 3).",
        factory=lambda: {"at2po": "A=V, child-weighted (AT2PO)",
                         "at2po_release": "A=V, child-softmax (released code)",
                         "at2po_child_mean": "A=V, child-mean",
                         "at2po_leaf_mean": "A=V, leaf-mean",
                         "at2po_diff_parent": "A=V−V_parent",
                         "at2po_diff_root": "A=V−V_root",
                         "at2po_diff_localglobal": "A=L+G"})
    beta_method: str = option(
        "a2tgpo", "Method of the β-sensitivity table and curve (A2TGPO Figure 9).")
    beta_main: float = option(
        0.3, "β of the β method's cells in the main and ablation tables and the other plots; "
        "other methods run at several β show their β = 0 cells.", ge=0)
    paired: tuple[tuple[str, ...], ...] = option(
        (("a2tgpo", "grpo"), ("a2tgpo", "igpo")),
        "Pairs [A, B] of method ids of the paired table: per backbone, the mean over the "
        "seeds both have of the per-seed difference A − B (the cells of the main table), with "
        "its paired 95% t-interval.")
    beta_reference_methods: tuple[str, ...] = option(
        ("grpo", "igpo"), "Methods drawn as horizontal reference lines in the β curve.")
    advantage_methods: tuple[str, ...] = option(
        ("grpo", "igpo", "a2tgpo"),
        "Methods of the advantage-by-turn-position plots (A2TGPO Figures 4-5).")
    jaccard_method: str = option(
        "a2tgpo", "Method whose sampled rollouts give the Jaccard similarity plot (A2TGPO "
        "Figure 1, App. C.5).")
    tail_steps: int = option(
        10, "The tool-call distribution averages the last this many logged training steps.", ge=1)
    smoothing: int = option(
        1, "Moving-average window (in logged points) of the training curves; 1 = none.", ge=1)
    selection_labels: dict[str, str] = option(
        doc="Caption wording of each checkpoint-selection criterion of the cells' summaries "
        "(a criterion not listed is shown by the summary's label).",
        factory=lambda: {"dev_em": "dev-selected",
                         "test_avg": "best test average (papers' protocol)"})
    dpi: int = option(150, "Resolution of the PNG plots.", ge=1)

    def __post_init__(self) -> None:
        if self.decimals < 0:
            raise ValueError(f"decimals must be >= 0, got {self.decimals}")
        if self.tail_steps < 1 or self.smoothing < 1 or self.dpi < 10:
            raise ValueError("tail_steps and smoothing must be >= 1, dpi >= 10")
        bad = [list(p) for p in self.paired if len(p) != 2 or p[0] == p[1]]
        if bad:
            raise ValueError(f"paired: each entry must be two different method ids, got {bad}")

    # ---- labels ---------------------------------------------------------------------------

    def method_label(self, method: str) -> str:
        return self.method_labels.get(method) or (METHODS[method].name if method in METHODS
                                                  else method)

    def backbone_label(self, backbone: str) -> str:
        return self.backbone_labels.get(backbone) or _BACKBONE_LABELS.get(backbone, backbone)

    def group_label(self, group: str) -> str:
        return self.group_labels.get(group) or _GROUP_LABELS.get(group, f"{group} avg")

    def dataset_key(self, name: str) -> tuple[str, str]:
        """(base name used for ordering and labels, label prefix) of a dataset name."""
        if name in self.datasets or name in self.dataset_labels or name in _DATASET_LABELS:
            return name, ""
        for prefix, shown in self.dataset_prefixes.items():
            if prefix and name.startswith(prefix):
                return name[len(prefix):], shown
        return name, ""

    def dataset_label(self, name: str) -> str:
        base, shown = self.dataset_key(name)
        return shown + (self.dataset_labels.get(base) or _DATASET_LABELS.get(base, base))

    def order_backbones(self, present) -> list[str]:
        present = set(present)
        return ([b for b in self.backbones if b in present]
                + sorted(present - set(self.backbones)))


def load_report_config(config: str | Path | None, section: str | None = None) -> ReportConfig:
    """The report section from a file (a resolved section, or `section` of a study config);
    the defaults without a file."""
    if config is None:
        return ReportConfig()
    from a2tgpo.config import load_config

    return load_config(ReportConfig, config, section=section)


# --------------------------------------------------------------------------------------------
# cells


def discover_cells(runs: str | Path | None = None, cells=None) -> list[Cell]:
    """The cells to report on: the explicit list (cell directories, or files inside a cell
    such as its eval/summary.json, as a Snakemake rule passes them), else every
    `backbone~*/method~*/beta~*/seed~*` directory under `runs` (with optional regime~ and
    data~ components). All of one training regime (Cell.regime). Sorted by wildcards."""
    found: dict[Path, Cell] = {}
    if cells:
        for given in cells:
            p = Path(given)
            # walk up from a file inside the cell to the seed~ directory
            while p.name and not p.name.startswith("seed~") and p != p.parent:
                p = p.parent
            cell = Cell.from_dir(p if p.name.startswith("seed~") else Path(given))
            found[cell.run_dir] = cell
    elif runs is not None:
        runs = Path(runs)
        if not runs.is_dir():
            raise FileNotFoundError(f"{runs}: runs directory not found")
        for pattern in ("backbone~*/method~*/beta~*/seed~*",
                        "backbone~*/data~*/method~*/beta~*/seed~*",
                        "backbone~*/regime~*/method~*/beta~*/seed~*",
                        "backbone~*/regime~*/data~*/method~*/beta~*/seed~*"):
            for p in sorted(runs.glob(pattern)):
                if p.is_dir():
                    found[p] = Cell.from_dir(p)
    else:
        raise ValueError("give a runs directory or a list of cells")
    regimes = sorted({c.regime for c in found.values()})
    if len(regimes) > 1:
        # a row is (backbone, method, beta, seed): runs of two regimes would share it
        names = ", ".join(r or "(none)" for r in regimes)
        raise ReportInputError(f"cells of several training regimes ({names}) in one report; "
                               "report each regime on its own (pass its cells with --cells)")
    return sorted(found.values())


def merge_tracks(cells: list[Cell]) -> list[Cell]:
    """One cell per (backbone, method, beta, seed) for the tables: the papers train one model
    per track (multi-hop, single-hop) and report both in one row, so the evaluations of a
    coordinate's track cells are merged (datasets and groups side by side; the overall
    average recomputed sample-weighted). A dataset evaluated by two tracks is an error."""
    groups: dict[tuple, list[Cell]] = defaultdict(list)
    for c in cells:
        groups[(c.backbone, c.method, c.beta, c.seed)].append(c)
    out = []
    for parts in groups.values():
        if len(parts) == 1 or not all(p.data for p in parts):
            out.extend(parts)
            continue
        summaries = [(p, p.summary()) for p in parts]
        if any(s is None for _, s in summaries):
            out.extend(p for p, s in summaries if s is not None)
            continue
        combined: dict = {"datasets": {}, "groups": {}}
        for p, s in summaries:
            for section in ("datasets", "groups"):
                for name, entry in s[section].items():
                    if section == "groups" and name == "all":
                        continue
                    if name in combined[section]:
                        raise ReportInputError(
                            f"{p.summary_path}: {section}.{name} is also evaluated by another "
                            f"track of {p.backbone}/{p.method}; give each dataset one track")
                    combined[section][name] = entry
            for key in ("criterion", "label"):
                combined.setdefault(key, s.get(key))
        rows = [e for e in combined["datasets"].values() if e.get("n")]
        n = sum(e["n"] for e in rows)
        if n:
            combined["groups"]["all"] = {
                "n": n, **{m: sum(e["n"] * e[m] for e in rows) / n for m in ("em", "f1")
                           if all(e.get(m) is not None for e in rows)}}
        out.append(dataclasses.replace(parts[0], data="+".join(sorted(p.data for p in parts)),
                                       _cache={"summary": combined}))
    return out


def split_tracks(cells: list[Cell]) -> list[Cell]:
    """For the plots: each track of a backbone is plotted on its own, as `<backbone>/<track>`."""
    return [dataclasses.replace(c, backbone=f"{c.backbone}/{c.data}") if c.data else c
            for c in cells]


def selection_label(cfg: ReportConfig, summary: dict) -> str:
    """How the cell's evaluated checkpoint was chosen, in caption words: the configured
    wording of its criterion, else the summary's own label."""
    criterion = summary.get("criterion")
    if criterion in cfg.selection_labels:
        return cfg.selection_labels[criterion]
    label = summary.get("label")
    if isinstance(label, str) and label:
        return label
    return str(criterion or "unknown selection")


def by_method(cells) -> dict[tuple[str, str], dict[float, list[Cell]]]:
    """{(backbone, method): {beta: [cells sorted by seed]}}."""
    out: dict[tuple[str, str], dict[float, list[Cell]]] = defaultdict(lambda: defaultdict(list))
    for c in cells:
        out[(c.backbone, c.method)][c.beta].append(c)
    for betas in out.values():
        for seeds in betas.values():
            seeds.sort(key=lambda c: c.seed)
    return out


def pick_cells(cfg: ReportConfig, grouped: dict[float, list[Cell]], method: str,
               where: str) -> list[Cell]:
    """The seeds that represent `method` in the main and ablation tables and the plots.

    A method run at one β: those cells. At several β: the β method's cells at `beta_main`,
    any other method's at β = 0 (the β sweep has its own table); absent -> [] and a note.
    """
    if not grouped:
        return []
    if len(grouped) == 1:
        return next(iter(grouped.values()))
    want = cfg.beta_main if method == cfg.beta_method else 0.0
    for beta, seeds in grouped.items():
        if math.isclose(beta, want, abs_tol=1e-12):
            return seeds
    log.info("%s: %s has cells at β %s but none at β %g; left out", where, method,
             ", ".join(map(format_value, sorted(grouped))), want)
    return []
