"""The experiment grid: named sets of cells (backbone x method x beta x seed) and their configs.

A cell (a2tgpo/cell.py) is one training run; its path under `<results>/<study>/runs/`,

    backbone~qwen3-4b/method~a2tgpo/beta~0.3/seed~1

names every coordinate.

Cells come from the study's `grid.sets` (e.g. main, beta, seeds); `grid.default` names the sets
a bare `snakemake` runs, the others are targets of their own (`snakemake beta`). A set lists
methods and, optionally, backbones (default: all of the study's), betas (default: each method's
own beta; a set with betas may list only methods that read beta, i.e. with loss.adaptive_clip)
and seeds, with exclusions as "backbone:method" pairs (Tree-GRPO only on Qwen2.5-7B in the
paper).

`cell_config` resolves one cell into the TrainConfig that `a2tgpo train` reads: the method file,
the set's beta, the study's `train` section, then the study's dotted overrides (all cells), then
the per-method overrides, validated strictly with the override's origin in any error.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from dataclasses import dataclass
from typing import Literal

from a2tgpo.cell import CELL_PATTERN as CELL_PATTERN  # the workflow's wildcard constraint
from a2tgpo.cell import Cell, normalize_beta
from a2tgpo.config import (
    SEED_LIMIT,
    ConfigError,
    InvalidKey,
    apply_overrides,
    from_dict,
    name_error,
    option,
    refuse_repeats,
    to_dict,
)
from a2tgpo.train.config import TrainSettings


@dataclass(frozen=True)
class CellSet:
    """One named set of cells: the cross product of its lists, minus exclusions."""

    methods: tuple[str, ...] = option(doc="Method ids (config/methods/<id>.yaml).")
    backbones: tuple[str, ...] = option((), "Backbone ids; empty = all of the study's backbones.")
    tracks: tuple[str, ...] = option((), "Training tracks (keys of the study's `tracks`); empty = "
                                         "all of them.")
    betas: tuple[float, ...] = option(
        (), "Adaptive-clip strengths β (a cell each); every method of the set must read β "
        "(loss.adaptive_clip: true). Empty = each method's own β.", ge=0)
    seeds: tuple[int, ...] = option((1,), "Seeds (one cell each).", ge=0, lt=SEED_LIMIT)
    exclude: tuple[str, ...] = option((), "\"backbone:method\" pairs left out (e.g. "
                                          "\"qwen3-4b:tree_grpo\").")
    only: tuple[str, ...] = option((), "\"backbone:method\" pairs: if given, a method listed "
                                       "here runs only on the backbones listed for it.")
    regime: str = option(
        "", "A training regime of the study (a key of train.regimes, e.g. a longer schedule) "
        "the set's cells run under, in runs/backbone~B/regime~R/...; their tables cover these "
        "cells only. Empty = the study's train section as it is.")

    def __post_init__(self) -> None:
        if not self.methods or not self.seeds:
            raise ValueError("a cell set needs at least one method and one seed")
        for pair in self.exclude + self.only:
            if pair.count(":") != 1:
                raise ValueError(f"expected \"backbone:method\", got {pair!r}")
        object.__setattr__(self, "betas", tuple(normalize_beta(b) for b in self.betas))
        # a value listed twice makes each of its cells twice: a seed counted twice in a mean
        # and its confidence interval
        for key in ("methods", "backbones", "tracks", "betas", "seeds"):
            refuse_repeats(key, getattr(self, key))


@dataclass(frozen=True)
class GridConfig:
    """The study's grid: named cell sets and which of them `snakemake` runs by default."""

    sets: dict[str, CellSet] = option(
        doc="Named cell sets; each is also a Snakemake target (`snakemake <name>`).")
    default: tuple[str, ...] = option(("main",), "Sets the default target runs; their cells "
                                                 "make the tables in <study>/tables/.")

    def __post_init__(self) -> None:
        if not self.default:
            raise InvalidKey("default", "name at least one set: the default target would run "
                                        "nothing")
        refuse_repeats("default", self.default)
        for name in self.default:
            if name not in self.sets:
                raise ValueError(f"default set {name!r} is not in sets ({', '.join(self.sets)})")
        for name in self.sets:  # also Snakemake targets and folders tables/<set>/
            if error := name_error(name):
                raise InvalidKey(f"sets.{name}", error)


GPU_SPEC_KEYS = ("hbm_tb_s", "bf16_tflops", "step_overhead_ms")  # a2tgpo.timing.gpu_spec's


@dataclass(frozen=True, kw_only=True)
class TrainSection(TrainSettings):
    """The study config's `train:` section: the TrainSettings every cell's TrainConfig starts
    from (per-cell values come from the grid), plus how the DAG runs the jobs."""

    nproc: int = option(1, "Processes per training job (backend deepspeed: GPUs per node).", ge=1)
    nodes: int = option(1, "Nodes per training job (backend deepspeed on SLURM).", ge=1)
    threads: int = option(1, "CPUs of a training job (SLURM cpus-per-task, OMP_NUM_THREADS); "
                             "backend deepspeed: `a2tgpo launch` gives each of the nproc ranks "
                             "threads / nproc. Evaluation jobs: eval.threads.", ge=1)
    overrides: tuple[str, ...] = option(
        (), "Dotted TrainConfig overrides applied to every cell, e.g. "
        "\"method.rollout.n=4\".")
    method_overrides: dict[str, tuple[str, ...]] = option(
        doc="Per-method dotted overrides (after `overrides`); keys are method ids or shell "
        "patterns (\"at2po*\"), applied in the order written, e.g. "
        "{tree_grpo: [\"method.rollout.tree_m=2\"]}.", factory=dict)
    regimes: dict[str, tuple[str, ...]] = option(
        doc="Named training regimes: dotted overrides (after `method_overrides`) a grid set "
        "trains its cells under (grid.sets.<set>.regime), e.g. {bench: "
        "[\"schedule.steps=40\"]}; such cells live under runs/backbone~B/regime~<name>/, "
        "apart from the same coordinates trained without it.", factory=dict)
    selection: Literal["dev_em", "test_avg"] = option(
        "dev_em", "Checkpoint selection: dev EM (default) or the papers' best test average "
        "(labelled so in the tables).")
    runtime_min: int = option(60, "Wall-time request of a training job (minutes, SLURM).", ge=1)
    seconds_per_step: float | None = option(
        None, "Wall time of one RL step (s) on the training nodes, for the train rule's "
        "retries; null = measured from a cell's metrics.jsonl once it has run, else the "
        "estimate of `a2tgpo plan` (GPU cells).", gt=0)
    spare_retries: int = option(
        2, "Retries of a training job beyond the jobs its run length needs at runtime_min "
        "(preemptions, node failures; a preempted job resumes from its checkpoint).", ge=0)
    mem_mb: int | None = option(
        8000, "Memory request of a training job (MB), checked against the job's host memory "
        "plan (`a2tgpo plan`); null = that plan x 1.25.", ge=1)
    gpu_memory_gb: float = option(
        80.0, "Memory of one GPU of the training nodes, GiB (nvidia-smi's total / 1024): what "
        "`a2tgpo plan` and the DAG check each cell's per-rank plan against.", gt=0)
    gpu_model: Literal["h20", "h100", "h200", "a100"] = option(
        "h100", "The training nodes' GPU, for `a2tgpo plan`'s step time (GPU-hours, the train "
        "rule's retries): its HBM bandwidth, bf16 peak and per-step overhead "
        "(a2tgpo/timing.py GPUS: h20, h100 = H100 SXM, h200, a100 = A100 SXM 80GB).")
    gpu_spec: dict[str, float] = option(
        doc="An explicit spec replacing the named GPU's numbers, any of: hbm_tb_s (TB/s), "
        "bf16_tflops (dense), step_overhead_ms (per engine step), e.g. {hbm_tb_s: 3.9}.",
        factory=dict, gt=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in self.gpu_spec:
            if key not in GPU_SPEC_KEYS:
                raise InvalidKey(f"gpu_spec.{key}", f"one of {', '.join(GPU_SPEC_KEYS)}")


@dataclass(frozen=True)
class TrackConfig:
    """One training track: a model trained on some training sets and tested on some test
    sets (A2TGPO/AT2PO: multi-hop = HotpotQA train -> 4 multi-hop test sets; single-hop = NQ
    train -> 3 single-hop test sets)."""

    train: tuple[str, ...] = option(doc="Names of data.train sources this track trains on.")
    test: tuple[str, ...] = option(doc="Names of data.test sources this track is tested on.")

    def __post_init__(self) -> None:
        refuse_repeats("train", self.train)
        refuse_repeats("test", self.test)


def cells_of(grid: GridConfig, set_name: str, study_backbones: tuple[str, ...],
             method_beta: dict[str, float],
             study_tracks: tuple[str, ...] = ("",)) -> list[Cell]:
    """The cells of one set, in a stable order (of a grid `validate_grid` accepted).

    `method_beta[m]`: the own β of every method id the set names; `study_tracks`: the study's
    track names ("" = no tracks).
    """
    s = grid.sets[set_name]
    backbones = s.backbones or study_backbones
    tracks = s.tracks or study_tracks
    excluded = {tuple(p.split(":")) for p in s.exclude}
    only: dict[str, set[str]] = {}
    for p in s.only:
        b, m = p.split(":")
        only.setdefault(m, set()).add(b)
    out = []
    for b in backbones:
        for m in s.methods:
            if (b, m) in excluded or (m in only and b not in only[m]):
                continue
            betas = s.betas or (normalize_beta(method_beta[m]),)
            for track in tracks:
                for beta in betas:
                    for seed in s.seeds:
                        out.append(Cell(b, m, beta, seed, track, s.regime))
    return out


def validate_grid(grid: GridConfig, study_backbones: tuple[str, ...], methods_dir: str,
                  source: str, study_tracks: tuple[str, ...] = ("",),
                  regimes: tuple[str, ...] = ()) -> dict[str, float]:
    """Check every id the grid names (`regimes`: the study's train.regimes), and that a set
    with betas lists only methods that read β; returns method id -> its own beta."""

    out: dict[str, float] = {}
    for name, s in grid.sets.items():
        if s.regime and s.regime not in regimes:
            raise ConfigError(f"{source}: grid.sets.{name}.regime: {s.regime!r} is not one of "
                              f"train.regimes ({', '.join(regimes) or 'none defined'})")
        for i, t in enumerate(s.tracks):
            if t not in study_tracks:
                raise ConfigError(f"{source}: grid.sets.{name}.tracks[{i}]: {t!r} is not one "
                                  f"of the study's tracks ({', '.join(study_tracks)})")
        for i, b in enumerate(s.backbones):
            if b not in study_backbones:
                raise ConfigError(f"{source}: grid.sets.{name}.backbones[{i}]: {b!r} is not "
                                  f"one of the study's backbones ({', '.join(study_backbones)})")
        for i, m in enumerate(s.methods):
            try:
                cfg = _method(m, methods_dir)  # cached: read once per process
            except ConfigError as e:
                raise ConfigError(f"{source}: grid.sets.{name}.methods[{i}]: {e}") from None
            out[m] = cfg.advantage.beta
            if s.betas and not cfg.reads_beta:
                # its cells would differ in name only: β is the adaptive-clip strength
                raise ConfigError(
                    f"{source}: grid.sets.{name}.betas: method {m!r} (methods[{i}]) does not "
                    "read β (its loss.adaptive_clip is false), so every β would train the same "
                    f"run; list only methods that read β in set {name!r}")
        # an entry that matches no cell of the set is refused, not ignored: a typo or a
        # backbone the set leaves out would silently train what it was meant to leave out
        backbones = s.backbones or study_backbones
        only: dict[str, set[str]] = {}
        for key, pairs in (("only", s.only), ("exclude", s.exclude)):
            for i, p in enumerate(pairs):
                b, m = p.split(":")
                if b not in backbones:
                    whose = "its" if s.backbones else "the study's"
                    why = f"backbone {b!r} is not one of {whose} backbones ({', '.join(backbones)})"
                elif m not in s.methods:
                    why = f"method {m!r} is not one of its methods ({', '.join(s.methods)})"
                elif key == "exclude" and m in only and b not in only[m]:
                    why = f"its `only` runs {m} on {', '.join(sorted(only[m]))} alone"
                else:
                    why = ""
                if why:
                    raise ConfigError(f"{source}: grid.sets.{name}.{key}[{i}]: {p!r} matches "
                                      f"no cell of the set: {why}")
                if key == "only":
                    only.setdefault(m, set()).add(b)
    return out


@functools.cache
def _method(method_id: str, methods_dir: str):
    """The method file, read once per process (the DAG resolves hundreds of cells)."""
    from a2tgpo.algo.methods import get_method

    return get_method(method_id, methods_dir)


def cell_config(cell: Cell, *, study: str, results_root: str, backbone, train: TrainSection,
                methods_dir: str, retrieval, tracking, train_file: str, dev_file: str,
                corpus: str, index: str | None):
    """The resolved TrainConfig of one cell (what `a2tgpo train` reads)."""
    from a2tgpo.train.config import TrainConfig

    method = _method(cell.method, methods_dir)
    method = dataclasses.replace(
        method, advantage=dataclasses.replace(method.advantage, beta=cell.beta))
    # a plain mapping first: the overrides may fix what the defaults alone would fail on
    data = {
        "run_dir": f"{results_root}/runs/{cell.path}", "results_dir": results_root,
        "study": study, "cell": cell.path, "seed": cell.seed, "backbone": to_dict(backbone),
        "method": to_dict(method), "train_file": train_file, "dev_file": dev_file,
        "corpus": corpus, "index": index, "retrieval": to_dict(retrieval),
        "tracking": to_dict(tracking),
        **{f.name: to_dict(getattr(train, f.name)) for f in dataclasses.fields(TrainSettings)}}
    layers = [("train.overrides", train.overrides)]
    layers += [(f"train.method_overrides.{key}", ov)
               for key, ov in train.method_overrides.items()
               if fnmatch.fnmatchcase(cell.method, key)]
    if cell.regime:
        if cell.regime not in train.regimes:
            raise ConfigError(f"cell {cell.path}: regime {cell.regime!r} is not one of "
                              f"train.regimes ({', '.join(train.regimes) or 'none defined'})")
        layers.append((f"train.regimes.{cell.regime}", train.regimes[cell.regime]))
    for label, overrides in layers:
        if overrides:
            try:
                data = apply_overrides(data, overrides)
            except ConfigError as e:
                raise ConfigError(f"study config {label}: {e}") from None
    try:
        cfg = from_dict(TrainConfig, data, source=f"cell {cell.path} (after study overrides)")
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"cell {cell.path} (study config train section and overrides): "
                          f"{e}") from None
    if train.selection == "test_avg":
        # the papers' protocol evaluates every saved checkpoint: none may be pruned
        sched = cfg.schedule
        keep = sched.steps // sched.save_every + 2
        if sched.keep_last < keep:
            cfg = dataclasses.replace(cfg, schedule=dataclasses.replace(sched, keep_last=keep))
    if cfg.method.advantage.beta != cell.beta:  # the path must say what the run does
        raise ConfigError(f"cell {cell.path}: an override changed method.advantage.beta to "
                          f"{cfg.method.advantage.beta}; set betas in grid.sets instead")
    return cfg


# --------------------------------------------------------------------------------------------
# rerunning one cell


def match_cells(cells: list[Cell], selectors: list[str]) -> list[Cell]:
    """The cells whose coordinates equal every `key=value` selector (backbone, regime, data,
    method, beta, seed); betas compare as numbers, so beta=0.30 selects beta~0.3. Without a
    regime= selector only cells trained without a regime match (their paths have no
    regime~): `method=grpo seed=1` names the main table's cell, not its bench twin."""
    wanted: dict[str, str] = {"regime": ""}
    for text in selectors:
        key, sep, value = text.partition("=")
        if not sep or key not in ("backbone", "regime", "data", "method", "beta", "seed"):
            raise ValueError(f"expected backbone=, regime=, data=, method=, beta= or seed=, "
                             f"got {text!r}")
        wanted[key] = value

    def ok(c: Cell) -> bool:
        for key, value in wanted.items():
            if key == "beta":
                if normalize_beta(float(value)) != c.beta:
                    return False
            elif key == "seed":
                if int(value) != c.seed:
                    return False
            elif getattr(c, key) != value:
                return False
        return True

    return [c for c in dict.fromkeys(cells) if ok(c)]
