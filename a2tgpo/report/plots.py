"""The papers' figures from the cells' metrics, rollouts and summaries (`a2tgpo plots`).

Written as `<out>/<backbone>/<kind>.png`, with `<out>/index.json` listing every file (kind,
backbone, caption file `workflow/report/plot_<kind>.rst`) and every plot skipped for lack of
data. Kinds:

- `dev_em`, `reward`, `entropy`: `val/em` (×100), `train/reward`, `rollout/entropy` over
  training steps, one line per method of `report.methods` (A2TGPO Figure 3), and a dashed
  line at the starting policy's value where cells logged the metric at step 0 (`warm_start`:
  the step-0 validation, so `dev_em` only).
- `outcomes`: why dev questions fail (`val/outcome/*`, a2tgpo/rollout/failures.py): the
  share of each outcome at the starting policy's validation (step 0) and at each method's last
  validation, overall and per hop type, as stacked bars (mean over seeds).
- `advantage_by_turn`: per method of `report.advantage_methods`, the advantage statistics of
  each turn position over all logged steps (A2TGPO Figure 4): mean of the per-step means with
  ± the mean per-step std, and the extreme per-step min and max.
- `advantage_over_steps`: per method, the per-turn mean advantage over steps inside the
  min/max envelope across turn positions (A2TGPO Figure 5).
- `tool_calls`: fraction of training trajectories with c tool calls, averaged over the last
  `report.tail_steps` logged steps (A2TGPO App. C.4).
- `jaccard`: same-position vs cross-position token-set Jaccard similarity of the turns of the
  rollouts of one question (A2TGPO Figure 1, App. C.5); see `jaccard_step`.
- `time_per_stage`: mean seconds per training step in each stage, stacked per method
  (A2TGPO App. C.1, Figure 7); its note gives the rollout's engine busy share, longest
  trajectory and search wait where the runs logged them.
- `beta`: the β method's group averages (test set, `report.metric` ×100) against β, with the
  reference methods as horizontal lines (A2TGPO Figure 9).
- `clip_by_turn`: the β method's clip fraction at each turn position in the updates after
  each step's first (`clip/later/by_turn/k`; the first is on-policy and never clips), one bar
  per β: where it is 0, β cannot change the run.

`advantage_by_turn` and `clip_by_turn` print their numbers under the panels and in the
index's `note`.

Every legend sits to the right of the axes, outside the data area, so it hides no line or bar
(saved with bbox_inches="tight", which widens the image to hold it).

With several seeds a line is the mean over the seeds that logged the step, with a band of ± one
sample standard deviation (n − 1 denominator) where at least two did. A metric logged twice at
one step (a resumed run) counts once, with the later value. Each method is drawn from the cells
the main table uses (`a2tgpo.report.pick_cells`).
"""

from __future__ import annotations

import logging
import re
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

import numpy as np

from a2tgpo.config import format_value
from a2tgpo.io import atomic_path, atomic_write_json
from a2tgpo.report import (
    Cell,
    ReportConfig,
    ReportInputError,
    by_method,
    pick_cells,
)

log = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"
PLOT_KINDS = ("dev_em", "reward", "entropy", "outcomes", "advantage_by_turn",
              "advantage_over_steps", "tool_calls", "jaccard", "time_per_stage", "beta",
              "clip_by_turn")
CURVES = {"dev_em": ("val/em", 100.0, "dev EM (%)"),
          "reward": ("train/reward", 1.0, "training reward (batch mean)"),
          "entropy": ("rollout/entropy", 1.0, "policy entropy of generated tokens")}
_ADV_RE = re.compile(r"^adv/turn(\d+)/(mean|std|min|max)$")
_TIME_TOTAL = "time/step"


# --------------------------------------------------------------------------------------------
# reading


def series(rows: list[dict], key: str) -> dict[int, float]:
    """{step: value} of `key`; a step logged twice keeps the later row's value."""
    out: dict[int, float] = {}
    for row in rows:
        if key in row and row[key] is not None and "step" in row:
            out[int(row["step"])] = float(row[key])
    return dict(sorted(out.items()))


def seed_band(per_seed: list[dict[int, float]], smoothing: int = 1):
    """(steps, mean, std) over seeds at every step any seed logged; std is NaN where fewer
    than two seeds have the step. Each seed's series is smoothed first (trailing window)."""
    per_seed = [_smooth(s, smoothing) for s in per_seed if s]
    steps = sorted({k for s in per_seed for k in s})
    mean, std = [], []
    for k in steps:
        vals = [s[k] for s in per_seed if k in s]
        mean.append(statistics.fmean(vals))
        std.append(statistics.stdev(vals) if len(vals) > 1 else float("nan"))
    return np.array(steps), np.array(mean), np.array(std)


def warm_start(rows_per_cell: Iterable[list[dict]], key: str = "val/em") -> float | None:
    """The starting policy's value of `key`: its step-0 value (the later row when step 0 was
    logged twice), averaged over the cells that logged it. Every method and seed starts from
    the same policy, so the cells differ only by validation noise. None when no cell did."""
    at_start = [s[0] for rows in rows_per_cell if 0 in (s := series(rows, key))]
    return statistics.fmean(at_start) if at_start else None


def _smooth(s: dict[int, float], window: int) -> dict[int, float]:
    if window <= 1 or len(s) < 2:
        return s
    keys, vals = list(s), list(s.values())
    return {k: statistics.fmean(vals[max(0, i - window + 1): i + 1]) for i, k in enumerate(keys)}


def read_rollouts(cell_dir: str | Path) -> list[dict] | None:
    """rollouts.jsonl of a cell (None when absent). A truncated last line (a writer killed
    mid-line) is ignored; a bad line elsewhere raises, naming file and line."""
    from a2tgpo.tracking import read_metrics

    path = Path(cell_dir) / ROLLOUTS_FILE
    if not path.exists():
        return None
    try:
        rows = read_metrics(cell_dir, ROLLOUTS_FILE)  # the same JSON-lines rules
    except ValueError as e:
        raise ReportInputError(str(e)) from e
    for i, row in enumerate(rows):
        for key in ("step", "group", "index", "turns"):
            if key not in row:
                raise ReportInputError(f"{path}:{i + 1}: missing key {key!r}")
    return rows


# --------------------------------------------------------------------------------------------
# Jaccard similarity of turns (A2TGPO Figure 1, App. C.5)

_WORD = re.compile(r"\w+")


def turn_tokens(turn: dict) -> frozenset[str]:
    """The token set of a turn: lower-cased `\\w+` words of its search query when it has a
    non-empty one, else of its action text."""
    query = turn.get("query")
    text = query if isinstance(query, str) and query.strip() else (turn.get("text") or "")
    return frozenset(_WORD.findall(text.lower()))


def jaccard(a: frozenset, b: frozenset) -> float | None:
    """|a ∩ b| / |a ∪ b|; None (the pair is skipped) when both sets are empty."""
    union = len(a | b)
    return None if union == 0 else len(a & b) / union


@dataclass
class JaccardStats:
    same: float | None  # mean over every same-position pair
    cross: float | None  # mean over every cross-position pair
    same_by_turn: dict[int, float]  # turn position -> mean over that position's pairs
    pairs_same: int
    pairs_cross: int


def jaccard_step(rows: list[dict]) -> JaccardStats:
    """Same- vs cross-position similarity of the turns of one step's sampled rollouts.

    Rollouts are grouped by `group` (the question); within a group, each rollout (`index`)
    contributes one token set per turn (`turn_tokens`), at its position `turn`. Over the
    pairs of turn instances from two *different* rollouts of the same group:

    - same-position pairs: both at position k (one pair per unordered pair of rollouts that
      both reach k); `same_by_turn[k]` is their mean Jaccard similarity, `same` the mean over
      the same-position pairs of every position;
    - cross-position pairs: at positions k ≠ l (every unordered pair of turn instances of two
      different rollouts); `cross` is their mean.

    Pairs are pooled over the step's groups, each pair weighing the same; pairs of two empty
    sets are skipped. Two turns of one rollout are never paired.
    """
    groups: dict[str, dict[int, dict[int, frozenset]]] = defaultdict(dict)
    for r in rows:
        # the turn's own position when logged, else its place in the list
        groups[str(r["group"])][int(r["index"])] = {int(t.get("turn", i)): turn_tokens(t)
                                                    for i, t in enumerate(r["turns"])}
    same: dict[int, list[float]] = defaultdict(list)
    cross: list[float] = []
    for rollouts in groups.values():
        for (_, a), (_, b) in combinations(sorted(rollouts.items()), 2):
            for k, sa in a.items():
                for m, sb in b.items():
                    j = jaccard(sa, sb)
                    if j is None:
                        continue
                    (same[k] if k == m else cross).append(j)
    all_same = [v for vals in same.values() for v in vals]
    return JaccardStats(
        same=statistics.fmean(all_same) if all_same else None,
        cross=statistics.fmean(cross) if cross else None,
        same_by_turn={k: statistics.fmean(v) for k, v in sorted(same.items())},
        pairs_same=len(all_same), pairs_cross=len(cross))


def jaccard_by_step(rows: list[dict], steps=None) -> dict[int, JaccardStats]:
    """`jaccard_step` of every sampled step (or only of `steps`)."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_step[int(r["step"])].append(r)
    return {s: jaccard_step(rs) for s, rs in sorted(by_step.items())
            if steps is None or s in steps}


# --------------------------------------------------------------------------------------------
# plotting


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


class _Writer:
    """Saves figures atomically and keeps the index of written and skipped plots."""

    def __init__(self, cfg: ReportConfig, out_dir: Path):
        self.cfg, self.out_dir = cfg, out_dir
        self.written: list[dict] = []
        self.skipped: list[dict] = []

    def save(self, fig, backbone: str, kind: str, note: str | None = None) -> None:
        """`note`: the plot's numbers in words, printed under the panels and kept in the index
        (the caption file explains the kind; the note says what this run's data shows)."""
        plt = _pyplot()
        path = self.out_dir / backbone / f"{kind}.png"
        if note:
            fig.text(0.0, 0.0, note, ha="left", va="top", fontsize=8, wrap=True,
                     transform=fig.transFigure)
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=self.cfg.dpi, bbox_inches="tight", format="png")
        plt.close(fig)
        entry = {"file": f"{backbone}/{kind}.png", "kind": kind, "backbone": backbone,
                 "caption": f"plot_{kind}.rst"}
        if note:
            entry["note"] = note
        self.written.append(entry)

    def skip(self, backbone: str, kind: str, reason: str) -> None:
        log.info("plot %s [%s] skipped: %s", kind, backbone, reason)
        self.skipped.append({"kind": kind, "backbone": backbone, "reason": reason})


def _legend_right(ax, handles=None, labels=None, fontsize: int = 8) -> None:
    """The legend to the right of `ax` (a figure's right-most panel), outside every data area.
    Without handles: `ax`'s own."""
    if handles is None:
        handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              fontsize=fontsize, frameon=False)


def _handles(axes) -> tuple[list, list[str]]:
    """Legend handles and labels of several panels, one per label (the first seen)."""
    seen: dict[str, object] = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, h)
    return list(seen.values()), list(seen)


def _colors(cfg: ReportConfig) -> dict[str, str]:
    ids = list(dict.fromkeys([*cfg.methods, *cfg.advantage_methods, cfg.beta_method]))
    palette = [f"C{i}" for i in range(10)]
    return {m: palette[i % 10] for i, m in enumerate(ids)}


def _method_cells(cfg, grouped, backbone, methods, where) -> dict[str, list[Cell]]:
    out = {}
    for m in methods:
        cells = pick_cells(cfg, grouped.get((backbone, m), {}), m, where)
        if cells:
            out[m] = cells
    return out


def _curve(w: _Writer, backbone: str, kind: str, cells: dict[str, list[Cell]]) -> None:
    key, scale, ylabel = CURVES[kind]
    cfg, colors = w.cfg, _colors(w.cfg)
    lines = {}
    start = warm_start((c.metrics() or [] for cs in cells.values() for c in cs), key)
    for m, cs in cells.items():
        per_seed = [{k: v * scale for k, v in series(c.metrics() or [], key).items()}
                    for c in cs]
        if any(per_seed):
            lines[m] = (seed_band(per_seed, cfg.smoothing), sum(1 for s in per_seed if s))
    if not lines:
        return w.skip(backbone, kind, f"no cell logged {key}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for m, ((x, mean, std), n) in lines.items():
        label = f"{cfg.method_label(m)} ({n} seed{'s' if n != 1 else ''})"
        ax.plot(x, mean, color=colors.get(m), label=label, marker="o" if len(x) < 3 else None)
        if np.isfinite(std).any():
            ax.fill_between(x, mean - std, mean + std, color=colors.get(m), alpha=0.2, lw=0)
    if start is not None:
        ax.axhline(start * scale, ls="--", lw=1, color="0.35", label="starting policy (step 0)")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} [{cfg.backbone_label(backbone)}]")
    ax.grid(alpha=0.3)
    _legend_right(ax)
    w.save(fig, backbone, kind)


def _validation_outcomes(rows: list[dict], first: bool) -> tuple[int, dict[str, float]] | None:
    """(step, {outcome key: share}) of the first or last validation that logged outcomes."""
    logged = [r for r in rows if "val/outcome/correct" in r and "step" in r]
    if not logged:
        return None
    row = min(logged, key=lambda r: r["step"]) if first else max(logged, key=lambda r: r["step"])
    return int(row["step"]), {k[len("val/outcome/"):]: float(v) for k, v in row.items()
                              if k.startswith("val/outcome/") and v is not None}


def outcome_bars(cfg: ReportConfig, cells: dict[str, list[Cell]]
                 ) -> dict[str, tuple[int, dict[str, float]]]:
    """{bar label: (step, {outcome key: share})}: the starting policy's step-0 validation
    (the same policy for every method; taken from the first cell that logged it), then each
    method's last validation, the mean over its seeds (the step is the latest of them)."""
    bars: dict[str, tuple[int, dict[str, float]]] = {}
    start = None
    for m, cs in cells.items():
        rows = [c.metrics() or [] for c in cs]
        if start is None:
            firsts = [f for f in (_validation_outcomes(r, first=True) for r in rows)
                      if f and f[0] == 0]
            start = firsts[0] if firsts else None
        ends = [e for e in (_validation_outcomes(r, first=False) for r in rows) if e and e[0] > 0]
        if ends:
            keys = set().union(*(e for _, e in ends))
            bars[cfg.method_label(m)] = (max(s for s, _ in ends), {
                k: statistics.fmean([e.get(k, 0.0) for _, e in ends]) for k in keys})
    return {"starting policy": start, **bars} if start is not None else bars


def _outcomes(w: _Writer, backbone: str, cells: dict[str, list[Cell]]) -> None:
    from a2tgpo.rollout.failures import OUTCOMES

    found = outcome_bars(w.cfg, cells)
    if not found:
        return w.skip(backbone, "outcomes", "no cell logged val/outcome/* metrics")
    bars = {b: shares for b, (_, shares) in found.items()}
    steps = {b: step for b, (step, _) in found.items()}
    groups = [""] + sorted({k.rsplit("/", 1)[0] + "/" for b in bars.values() for k in b
                            if "/" in k})
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups) + 1.8,
                                                      0.32 * len(bars) + 1.4),
                             sharey=True, squeeze=False,
                             layout="constrained")  # keeps the title off the panel titles
    colors = {o: c for o, c in zip(OUTCOMES, ("#2ca02c", "#7f7f7f", "#9467bd", "#d62728",
                                              "#ff7f0e", "#1f77b4"), strict=True)}
    labels = [f"{b} (step {steps[b]})" for b in bars]
    y = np.arange(len(bars))
    for ax, g in zip(axes[0], groups, strict=True):
        left = np.zeros(len(bars))
        for o in OUTCOMES:
            v = np.array([100 * bars[b].get(g + o, 0.0) for b in bars])
            ax.barh(y, v, left=left, color=colors[o], label=o.replace("_", " "))
            left += v
        ax.set_title(g.rstrip("/") or "all questions", fontsize=9)
        ax.set_xlim(0, 100)
        ax.set_xlabel("dev questions (%)")
    axes[0][0].set_yticks(y, labels, fontsize=8)
    axes[0][0].invert_yaxis()
    _legend_right(axes[0][-1], *axes[0][0].get_legend_handles_labels())
    fig.suptitle(f"Validation outcomes, starting policy vs last validation "
                 f"[{w.cfg.backbone_label(backbone)}]", fontsize=10)
    w.save(fig, backbone, "outcomes")


def _turn_table(rows: list[dict], pattern: re.Pattern = _ADV_RE
                ) -> dict[int, dict[str, dict[int, float]]]:
    """{turn position: {stat: {step: value}}} from the keys `pattern` matches: group 1 the turn,
    group 2 the stat ("value" where it has none); a later row of a step wins."""
    out: dict[int, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        for key, v in row.items():
            m = pattern.match(key)
            if m and v is not None and "step" in row:
                stat = m.group(2) if pattern.groups > 1 else "value"
                out[int(m.group(1))][stat][int(row["step"])] = float(v)
    return out


def _advantage_by_turn(w: _Writer, backbone: str, cells: dict[str, list[Cell]]) -> None:
    per_method = {}
    for m, cs in cells.items():
        stats: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for c in cs:
            for k, by_stat in _turn_table(c.metrics() or []).items():
                for stat, values in by_stat.items():
                    stats[k][stat].extend(values.values())
        if stats:
            per_method[m] = stats
    if not per_method:
        return w.skip(backbone, "advantage_by_turn", "no cell logged adv/turn{k}/* metrics")
    plt = _pyplot()
    cfg, colors = w.cfg, _colors(w.cfg)
    fig, axes = plt.subplots(1, len(per_method), figsize=(3.6 * len(per_method), 3.6),
                             sharey=True, squeeze=False, layout="constrained")
    for ax, (m, stats) in zip(axes[0], per_method.items(), strict=True):
        ks = sorted(stats)
        mean = [statistics.fmean(stats[k]["mean"]) if stats[k]["mean"] else np.nan for k in ks]
        std = [statistics.fmean(stats[k]["std"]) if stats[k]["std"] else 0.0 for k in ks]
        lo = [min(stats[k]["min"]) if stats[k]["min"] else np.nan for k in ks]
        hi = [max(stats[k]["max"]) if stats[k]["max"] else np.nan for k in ks]
        ax.vlines(ks, lo, hi, color="0.6", lw=1, label="min–max")
        ax.errorbar(ks, mean, yerr=std, fmt="o", color=colors.get(m), capsize=4,
                    label="mean ± std")
        ax.axhline(0.0, color="0.3", lw=0.6)
        ax.set_title(cfg.method_label(m))
        ax.set_xlabel("turn position")
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("advantage (all logged steps)")
    _legend_right(axes[0][-1], *axes[0][0].get_legend_handles_labels())
    fig.suptitle(f"Advantage by turn position [{cfg.backbone_label(backbone)}]")
    w.save(fig, backbone, "advantage_by_turn", advantage_note(cfg, per_method))


def advantage_note(cfg: ReportConfig, per_method) -> str:
    """The plot's numbers: per method, the mean advantage at each turn position and the
    position bias, last position's mean minus the first's (A2TGPO Figure 4: IGPO's grows with
    the position, turn-group normalisation keeps it near 0)."""
    parts = []
    for m, stats in per_method.items():
        ks = [k for k in sorted(stats) if stats[k]["mean"]]
        means = [statistics.fmean(stats[k]["mean"]) for k in ks]
        if not means:
            continue
        bias = f"; last − first {means[-1] - means[0]:+.2f}" if len(means) > 1 else ""
        parts.append(f"{cfg.method_label(m)} " + " / ".join(f"{v:+.2f}" for v in means) + bias)
    return "Mean advantage at turn positions 0, 1, ...: " + " | ".join(parts) + "."


def _advantage_over_steps(w: _Writer, backbone: str, cells: dict[str, list[Cell]]) -> None:
    per_method = {}
    for m, cs in cells.items():
        tables = [_turn_table(c.metrics() or []) for c in cs]
        if any(tables):
            per_method[m] = tables
    if not per_method:
        return w.skip(backbone, "advantage_over_steps", "no cell logged adv/turn{k}/* metrics")
    plt = _pyplot()
    cfg = w.cfg
    fig, axes = plt.subplots(1, len(per_method), figsize=(3.8 * len(per_method), 3.6),
                             sharey=True, squeeze=False, layout="constrained")
    for ax, (m, tables) in zip(axes[0], per_method.items(), strict=True):
        # envelope: the most extreme per-turn min/max at each step, averaged over seeds
        lo_seeds, hi_seeds = [], []
        for t in tables:
            lo, hi = defaultdict(list), defaultdict(list)
            for by_stat in t.values():
                for s, v in by_stat.get("min", {}).items():
                    lo[s].append(v)
                for s, v in by_stat.get("max", {}).items():
                    hi[s].append(v)
            lo_seeds.append({s: min(v) for s, v in lo.items()})
            hi_seeds.append({s: max(v) for s, v in hi.items()})
        x_lo, y_lo, _ = seed_band(lo_seeds)
        x_hi, y_hi, _ = seed_band(hi_seeds)
        if len(x_lo) and np.array_equal(x_lo, x_hi):
            ax.fill_between(x_lo, y_lo, y_hi, color="0.85", label="min–max over turns")
        for k in sorted({k for t in tables for k in t}):
            x, mean, _ = seed_band([t[k]["mean"] for t in tables if k in t and "mean" in t[k]],
                                   cfg.smoothing)
            if len(x):
                ax.plot(x, mean, label=f"turn {k} mean", lw=1.2, color=f"C{k % 10}")
        ax.axhline(0.0, color="0.3", lw=0.6)
        ax.set_title(cfg.method_label(m))
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    _legend_right(axes[0][-1], *_handles(axes[0]))  # a turn has one colour in every panel
    axes[0][0].set_ylabel("advantage")
    fig.suptitle(f"Advantage over training [{cfg.backbone_label(backbone)}]")
    w.save(fig, backbone, "advantage_over_steps")


def _tool_calls(w: _Writer, backbone: str, cells: dict[str, list[Cell]]) -> None:
    cfg, colors = w.cfg, _colors(w.cfg)
    dists, means = {}, {}
    prefix = "rollout/tool_calls_dist/"
    for m, cs in cells.items():
        seed_dists, seed_means = [], []
        for c in cs:
            rows = c.metrics() or []
            by_step: dict[int, dict[int, float]] = {}
            for row in rows:  # later rows win, as for every metric
                d = {int(k[len(prefix):]): float(v) for k, v in row.items()
                     if k.startswith(prefix) and v is not None}
                if d and "step" in row:
                    by_step[int(row["step"])] = d
            tail = sorted(by_step)[-cfg.tail_steps:]
            if not tail:
                continue
            calls = sorted({c_ for s in tail for c_ in by_step[s]})
            seed_dists.append({c_: statistics.fmean(by_step[s].get(c_, 0.0) for s in tail)
                               for c_ in calls})
            mean_calls = series(rows, "rollout/tool_calls")
            if any(s in mean_calls for s in tail):
                seed_means.append(statistics.fmean(mean_calls[s] for s in tail
                                                   if s in mean_calls))
        if seed_dists:
            calls = sorted({c_ for d in seed_dists for c_ in d})
            dists[m] = {c_: statistics.fmean(d.get(c_, 0.0) for d in seed_dists)
                        for c_ in calls}
            means[m] = statistics.fmean(seed_means) if seed_means else None
    if not dists:
        return w.skip(backbone, "tool_calls", "no cell logged rollout/tool_calls_dist/*")
    plt = _pyplot()
    calls = sorted({c_ for d in dists.values() for c_ in d})
    width = 0.8 / len(dists)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.9 * len(calls) + 3), 3.8))
    for i, (m, d) in enumerate(dists.items()):
        label = cfg.method_label(m)
        if means[m] is not None:
            label += f" (mean {means[m]:.2f})"
        ax.bar([c_ + (i - (len(dists) - 1) / 2) * width for c_ in calls],
               [d.get(c_, 0.0) for c_ in calls], width=width, color=colors.get(m), label=label)
    ax.set_xticks(calls)
    ax.set_xlabel("tool calls per trajectory")
    ax.set_ylabel("fraction of trajectories")
    ax.set_title(f"Tool calls, last {cfg.tail_steps} logged steps "
                 f"[{cfg.backbone_label(backbone)}]")
    ax.grid(alpha=0.3, axis="y")
    _legend_right(ax)
    w.save(fig, backbone, "tool_calls")


def _jaccard(w: _Writer, backbone: str, cells: list[Cell]) -> None:
    cfg = w.cfg
    per_seed = []
    for c in cells:
        rows = read_rollouts(c.run_dir)
        if rows:
            sampled = [int(r["step"]) for r in rows]
            per_seed.append(jaccard_by_step(rows, {min(sampled), max(sampled)}))
    per_seed = [s for s in per_seed if any(v.same is not None for v in s.values())]
    if not per_seed:
        return w.skip(backbone, "jaccard",
                      f"no {ROLLOUTS_FILE} with comparable turns in the {cfg.jaccard_method} "
                      "cells")
    # the first and the last sampled step of each seed (paper: step 1 vs after training)
    picks = {"first": [s[min(s)] for s in per_seed], "last": [s[max(s)] for s in per_seed]}
    if all(min(s) == max(s) for s in per_seed):
        picks.pop("last")
    steps = {name: sorted({(min(s) if name == "first" else max(s)) for s in per_seed})
             for name in picks}
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.0, 3.6),
                                   gridspec_kw={"width_ratios": [3, 2]})
    for i, (name, stats) in enumerate(picks.items()):
        label = f"step {'/'.join(map(str, steps[name]))}"
        ks = sorted({k for s in stats for k in s.same_by_turn})
        ys = [statistics.fmean([s.same_by_turn[k] for s in stats if k in s.same_by_turn])
              for k in ks]
        ax1.plot(ks, ys, marker="o", label=label, color=f"C{i}")
        same = [s.same for s in stats if s.same is not None]
        cross = [s.cross for s in stats if s.cross is not None]
        vals = [statistics.fmean(same) if same else np.nan,
                statistics.fmean(cross) if cross else np.nan]
        ax2.bar(np.array([0, 1]) + (i - 0.5 * (len(picks) - 1)) * 0.35, vals, width=0.35,
                color=f"C{i}", label=label)
    ax1.set_xticks(sorted({k for st in picks.values() for s in st for k in s.same_by_turn}))
    ax1.set_xlabel("turn position")
    ax1.set_ylabel("Jaccard similarity, same position")
    ax1.set_ylim(0, 1)
    ax1.grid(alpha=0.3)
    ax2.set_xticks([0, 1], ["same position", "cross position"])
    ax2.set_ylim(0, 1)
    ax2.grid(alpha=0.3, axis="y")
    _legend_right(ax2, *_handles([ax1]))  # the same steps and colours in both panels
    fig.suptitle(f"Turn similarity within a question's rollouts, "
                 f"{cfg.method_label(cfg.jaccard_method)} [{cfg.backbone_label(backbone)}]")
    w.save(fig, backbone, "jaccard")


# the rollout's own numbers (a2tgpo/train/rl.py ROLLOUT_TIMES), printed under the bars: how
# much of the rollout stage the engine worked, and what the trajectories waited for
_ROLLOUT_NOTE = (("rollout/engine_busy", "engine busy {:.0%}"),
                 ("rollout/longest_trajectory_s", "longest trajectory {:.1f} s"),
                 ("rollout/search_wait_s", "search wait {:.1f} s per trajectory"))


def _rollout_note(cfg: ReportConfig, cells: dict[str, list[Cell]]) -> str | None:
    """Per method, the mean over steps and seeds of each `_ROLLOUT_NOTE` metric it logged."""
    parts = []
    for m, cs in cells.items():
        said = []
        for key, fmt in _ROLLOUT_NOTE:
            per_seed = [list(series(c.metrics() or [], key).values()) for c in cs]
            means = [statistics.fmean(v) for v in per_seed if v]
            if means:
                said.append(fmt.format(statistics.fmean(means)))
        if said:
            parts.append(f"{cfg.method_label(m)} {', '.join(said)}")
    return "Rollout per step (mean): " + " | ".join(parts) + "." if parts else None


def _time_per_stage(w: _Writer, backbone: str, cells: dict[str, list[Cell]]) -> None:
    cfg = w.cfg
    per_method: dict[str, dict[str, float]] = {}
    for m, cs in cells.items():
        seeds = []
        for c in cs:
            rows = c.metrics() or []
            keys = sorted({k for r in rows for k in r if k.startswith("time/")})
            stages = {k[len("time/"):]: series(rows, k) for k in keys if k != _TIME_TOTAL}
            total = series(rows, _TIME_TOTAL)
            if not total:
                continue
            means = {name: statistics.fmean(s.get(step, 0.0) for step in total)
                     for name, s in stages.items()}
            # what the stage timers do not cover (metrics, sampling bookkeeping, ...)
            means["other"] = max(0.0, statistics.fmean(total.values()) - sum(means.values()))
            seeds.append(means)
        if seeds:
            names = sorted({n for s in seeds for n in s})
            per_method[m] = {n: statistics.fmean(s.get(n, 0.0) for s in seeds) for n in names}
    if not per_method:
        return w.skip(backbone, "time_per_stage", f"no cell logged {_TIME_TOTAL}")
    stage_order = ["rollout", "info_gain+old_logprob", "info_gain", "old_logprob",
                   "ref_logprob", "advantage", "update"]
    names = sorted({n for d in per_method.values() for n in d},
                   key=lambda n: (stage_order.index(n) if n in stage_order
                                  else len(stage_order) + (n == "other"), n))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(per_method) + 3), 4.0))
    x = np.arange(len(per_method))
    bottom = np.zeros(len(per_method))
    for i, n in enumerate(names):
        h = np.array([d.get(n, 0.0) for d in per_method.values()])
        ax.bar(x, h, bottom=bottom, label=n, color=f"C{i % 10}")
        bottom += h
    ax.set_xticks(x, [cfg.method_label(m) for m in per_method], rotation=30, ha="right")
    ax.set_ylabel("seconds per training step (mean)")
    ax.set_title(f"Time per stage [{cfg.backbone_label(backbone)}]")
    ax.grid(alpha=0.3, axis="y")
    _legend_right(ax, *[list(reversed(x)) for x in ax.get_legend_handles_labels()])  # as stacked
    w.save(fig, backbone, "time_per_stage", note=_rollout_note(cfg, cells))


def _group_value(cfg: ReportConfig, cell: Cell, group: str) -> float | None:
    s = cell.summary()
    v = None if s is None else s["groups"].get(group, {}).get(cfg.metric)
    return None if v is None else 100.0 * float(v)


def _beta(w: _Writer, backbone: str, grouped) -> None:
    cfg = w.cfg
    betas = grouped.get((backbone, cfg.beta_method), {})
    evaluated = {b: [c for c in cs if c.summary() is not None] for b, cs in betas.items()}
    evaluated = {b: cs for b, cs in evaluated.items() if cs}
    groups = [g for g in cfg.groups
              if any(_group_value(cfg, c, g) is not None for cs in evaluated.values()
                     for c in cs)]
    if len(evaluated) < 2 or not groups:
        return w.skip(backbone, "beta", f"fewer than two evaluated β values of "
                      f"{cfg.beta_method}")
    refs = _method_cells(cfg, grouped, backbone, cfg.beta_reference_methods, "plot beta")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False,
                             layout="constrained")  # keeps each panel's y label clear
    order = sorted(evaluated)
    for ax, g in zip(axes[0], groups, strict=True):
        xs, ys, es = [], [], []
        for b in order:
            vals = [v for c in evaluated[b] if (v := _group_value(cfg, c, g)) is not None]
            if vals:
                xs.append(b)
                ys.append(statistics.fmean(vals))
                es.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
        ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3,
                    label=cfg.method_label(cfg.beta_method), color="C0")
        for i, (m, cs) in enumerate(refs.items()):
            vals = [v for c in cs if (v := _group_value(cfg, c, g)) is not None]
            if vals:
                ax.axhline(statistics.fmean(vals), ls="--", lw=1, color=f"C{i + 1}",
                           label=cfg.method_label(m))
        ax.set_xticks(order, [format_value(b) for b in order])
        ax.set_xlabel("β")
        ax.set_ylabel(f"{cfg.group_label(g)} {cfg.metric.upper()} (%)")
        ax.grid(alpha=0.3)
    # the β method first, then the references
    entries = sorted(zip(*_handles(axes[0]), strict=True),
                     key=lambda e: e[1] != cfg.method_label(cfg.beta_method))
    _legend_right(axes[0][-1], [h for h, _ in entries], [label for _, label in entries])
    fig.suptitle(f"β sensitivity of {cfg.method_label(cfg.beta_method)} "
                 f"[{cfg.backbone_label(backbone)}]")
    w.save(fig, backbone, "beta")


_CLIP_LATER_RE = re.compile(r"^clip/later/by_turn/(\d+)$")


def clip_by_turn(cells: list[Cell]) -> dict[int, float]:
    """{turn position: clip fraction of the later updates (`clip/later/by_turn/k`), mean over
    the logged steps of each cell, then over the cells}; {} when none logged it."""
    per_cell = []
    for c in cells:
        turns = _turn_table(c.metrics() or [], _CLIP_LATER_RE)
        if turns:
            per_cell.append({k: statistics.fmean(v["value"].values()) for k, v in turns.items()})
    turns = sorted({k for d in per_cell for k in d})
    return {k: statistics.fmean(d[k] for d in per_cell if k in d) for k in turns}


def _clip_by_turn(w: _Writer, backbone: str, grouped) -> None:
    cfg = w.cfg
    betas = grouped.get((backbone, cfg.beta_method), {})
    fractions = {b: f for b, cs in sorted(betas.items()) if (f := clip_by_turn(cs))}
    if not fractions:
        return w.skip(backbone, "clip_by_turn", f"no {cfg.beta_method} cell logged "
                      "clip/later/by_turn/* (a step needs at least two updates)")
    plt = _pyplot()
    turns = sorted({k for f in fractions.values() for k in f})
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(turns) * max(1, len(fractions)) / 2, 3.6),
                           layout="constrained")
    width = 0.8 / len(fractions)
    cmap = plt.get_cmap("viridis")
    for i, (b, f) in enumerate(fractions.items()):
        xs = [k - 0.4 + width * (i + 0.5) for k in turns]
        ax.bar(xs, [100.0 * f.get(k, np.nan) for k in turns], width=width,
               color=cmap(i / max(1, len(fractions) - 1)), label=f"β = {format_value(b)}")
    ax.set_xticks(turns)
    ax.set_xlabel("turn position")
    ax.set_ylabel("clipped tokens, later updates (%)")
    ax.grid(alpha=0.3, axis="y")
    _legend_right(ax)
    fig.suptitle(f"Clip fraction by turn, {cfg.method_label(cfg.beta_method)} "
                 f"[{cfg.backbone_label(backbone)}]")
    note = "Clipped tokens (%) at turn positions 0, 1, ... in the updates after each step's " \
        "first: " + " | ".join(f"β={format_value(b)} " + " / ".join(
            f"{100.0 * f[k]:.2f}" if k in f else "–" for k in turns)
            for b, f in fractions.items()) + "."
    w.save(fig, backbone, "clip_by_turn", note)


def write_plots(cfg: ReportConfig, cells: list[Cell], out_dir: str | Path) -> list[Path]:
    """Every plot the data allows, per backbone; returns the written PNG paths (and writes
    `<out_dir>/index.json`, which lists them and the plots skipped with the reason)."""
    out_dir = Path(out_dir)
    w = _Writer(cfg, out_dir)
    grouped = by_method(cells)
    for b in cfg.order_backbones(c.backbone for c in cells):
        main = _method_cells(cfg, grouped, b, cfg.methods, f"plots [{b}]")
        for kind in CURVES:
            _curve(w, b, kind, main)
        _outcomes(w, b, main)
        adv = _method_cells(cfg, grouped, b, cfg.advantage_methods, f"plots [{b}]")
        _advantage_by_turn(w, b, adv)
        _advantage_over_steps(w, b, adv)
        _tool_calls(w, b, main)
        jac = pick_cells(cfg, grouped.get((b, cfg.jaccard_method), {}), cfg.jaccard_method,
                         f"plot jaccard [{b}]")
        _jaccard(w, b, jac)
        _time_per_stage(w, b, main)
        _beta(w, b, grouped)
        _clip_by_turn(w, b, grouped)
    if not cells:
        log.info("no cells found: no plots")
    atomic_write_json(out_dir / "index.json", {"plots": w.written, "skipped": w.skipped})
    return [out_dir / p["file"] for p in w.written]


def main(config: str | Path | None, section: str | None, runs: str | Path | None,
         cells: list[str] | None, out: str | Path) -> int:
    from a2tgpo.report import discover_cells, load_report_config, split_tracks

    cfg = load_report_config(config, section)
    written = write_plots(cfg, split_tracks(discover_cells(runs, cells)), out)
    for path in written:
        print(path)
    if not written:
        print(f"no plots written (no data for any); see {Path(out) / 'index.json'}")
    return 0
