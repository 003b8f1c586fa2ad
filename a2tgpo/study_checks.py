"""Every check of a study that needs more than its own file (`check_study`): what Snakemake
runs before it schedules any job (workflow/rules/common.smk) and `a2tgpo check-config` runs.

Above the planner in the layer order (pyproject.toml, [tool.importlinter]): the planner reads
the study's cells and paths (a2tgpo/study.py), and these checks run the planner. The planner and
the sweeps are imported where they are used: a job's own Snakemake parses the workflow without
planning, and skips them.
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from a2tgpo.cell import Cell
from a2tgpo.config import ConfigError, format_value
from a2tgpo.model.backbone import model_context
from a2tgpo.study import StudyConfig, encoder_dir, resolve_cell, study_cells
from a2tgpo.train.reader import check_reader_worlds

if TYPE_CHECKING:
    from a2tgpo.plan import CellPlan, EvalPlan, RetryPlan
    from a2tgpo.sweep import SweepConfig

@dataclass
class StudyChecks:
    """What the checks of `check_study` derived, for the DAG to use (common.smk)."""

    cells: dict[str, list[Cell]]  # grid set -> its cells
    sweeps: dict[str, tuple[str, SweepConfig, Cell]]  # sweep name -> (file, sweep, base cell)
    plans: list[CellPlan] | None = None  # every cell's (plan=True only)
    evals: list[EvalPlan] | None = None  # every backbone's
    retries: RetryPlan | None = None  # the train rule's


def check_study(study: StudyConfig, source: str, *, plan: bool = True) -> StudyChecks:
    """Every check of the study that needs more than its own file, in one place: Snakemake
    runs it before it schedules anything (workflow/rules/common.smk) and `a2tgpo check-config`
    runs it, so a config the one accepts the other accepts too. Raises ConfigError, its
    message led by `source` (the config's files).

    0. values a late job would refuse, checked in milliseconds: backbone paths and the
       encoder id, the index factory, dev_size against training rows on disk
       (_check_load_time_values);
    1. built (toy) backbones share one folder; a toy reader was not pretrained on the study's
       world (its questions would be memorised, not read);
    2. the grid: every id it names exists, β only for methods that read it (validate_grid);
       every train.method_overrides key matches a method id;
    3. the sweeps: each file loads, names a backbone, track and method of the study, and a
       name no other sweep has;
    4. with `plan`: every cell's resolved config (overrides applied) and its memory plan, and
       every evaluation job's, fit their GPUs and memory requests; the train rule's retries.
    """
    _check_load_time_values(study, source)
    toy_paths = {study.backbone(b).path for b in study.backbones if study.backbone(b).needs_build}
    if len(toy_paths) > 1:
        raise ConfigError(f"{source}: backbones: all built (toy) backbones must share one "
                          "path; got " + ", ".join(sorted(toy_paths)))
    if study.corpus.source == "world":
        for b in study.backbones:
            check_reader_worlds(study.backbone(b).path, study.world.seed,
                                f"{source}: backbone {b}")
    cells = study_cells(study)
    sweeps = _study_sweeps(study, source)
    # a pattern may name methods this grid leaves out (a shared config, a trimmed grid), not
    # methods that do not exist: a typo would silently leave its method unchanged
    from a2tgpo.algo.methods import method_ids

    known = method_ids(study.methods_dir)
    for key in study.train.method_overrides:
        if not any(fnmatch.fnmatchcase(m, key) for m in known):
            near = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{source}: train.method_overrides.{key}: matches no method id "
                              f"({', '.join(known)}){hint}")
    _check_contexts(study, source)
    _check_cells(study, source, cells)
    _check_report(study, source, known, cells)
    checks = StudyChecks(cells=cells, sweeps=sweeps)
    if plan:
        from a2tgpo.plan import plan_evals, plan_retries, plan_study, refusal

        checks.plans, checks.evals = plan_study(study), plan_evals(study)
        refused = refusal(checks.plans, checks.evals)
        if refused:
            raise ConfigError(f"{source}: {refused}")
        checks.retries = plan_retries(study, checks.plans,
                                      {p.cell: f"{study.root}/runs/{p.cell}"
                                       for p in checks.plans})
        if checks.retries.error:
            raise ConfigError(f"{source}: {checks.retries.error}")
    return checks


def _check_load_time_values(study: StudyConfig, source: str) -> None:
    """What a late job would find wrong, found in milliseconds: the released backbones' paths
    and a dense retriever's encoder (a local model folder or a well-formed hub id,
    model_id_error), the index factory of an index the DAG builds (faiss makes an empty one at
    the encoder's width, factory_error), and each track's dev_size against its training rows
    where these are local files already on disk (qa.known_rows)."""
    from a2tgpo.data.qa import dev_size_error, known_rows
    from a2tgpo.model.fetch import model_id_error
    from a2tgpo.retrieval.encoders import MINILM
    from a2tgpo.retrieval.index import factory_error

    for i, b in enumerate(study.backbones):
        cfg = study.backbone(b)
        if not cfg.needs_build and (error := model_id_error(cfg.path)):
            raise ConfigError(f"{source}: backbones[{i}]: {Path(study.backbones_dir)}/{b}.yaml: "
                              f"path: {error}")
    r = study.retrieval
    if r.retriever == "dense":
        if error := model_id_error(r.encoder.model, builtin=(MINILM,)):
            raise ConfigError(f"{source}: retrieval.encoder.model: {error}")
        if r.index.prebuilt is None and (error := factory_error(r.index.factory,
                                                                _encoder_width(study))):
            raise ConfigError(f"{source}: retrieval.index.factory: {error}")
        if r.index.prebuilt is not None and not Path(r.index.prebuilt).is_file():
            download = study.corpus.download
            written = study.root / "corpus" / download.index.combined_name  # download_corpus
            made = (study.corpus.source == "hub" and download.index.enabled
                    and Path(r.index.prebuilt) == written)
            if not made:
                raise ConfigError(
                    f"{source}: retrieval.index.prebuilt: no such file: {r.index.prebuilt} (nor "
                    "the index the corpus download writes: "
                    + (f"{study.root}/corpus/{download.index.combined_name})"
                       if download.index.enabled else "corpus.download.index.enabled is false)"))
    for track in study.track_names:
        data = study.track_data(track)
        rows = [known_rows(s) for s in data.train]
        if None not in rows and (error := dev_size_error(
                data.dev_size, sum(rows), [f"{s.name} in {s.repo}" for s in data.train])):
            where = f" (track {track}: {', '.join(s.name for s in data.train)})" if track else ""
            raise ConfigError(f"{source}: data.dev_size{where}: {error}")


def _encoder_width(study: StudyConfig) -> int | None:
    """The dense encoder's output width, where known without loading it: retrieval.index.dim,
    else the hidden_size of its config.json on disk (the offline MiniLM's, a local folder's,
    a fetched one's)."""
    import json

    from a2tgpo.retrieval.encoders import model_path

    if study.retrieval.index.dim is not None:
        return study.retrieval.index.dim
    for folder in (model_path(study.retrieval.encoder), encoder_dir(study)):
        try:
            return int(json.loads((Path(folder) / "config.json").read_text())["hidden_size"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def _check_report(study: StudyConfig, source: str, known: list[str],
                  cells: dict[str, list[Cell]]) -> None:
    """The report names methods that exist, and its beta_main is a β the grid runs its
    beta_method at: a typo there would leave a row, a line or a whole table empty. (Backbone
    and dataset lists are orders for whatever the results hold, the papers' by default, so
    names absent from this study are expected there.)"""
    r = study.report
    named = [("methods", r.methods), ("method_labels", tuple(r.method_labels)),
             ("ablation_a2tgpo", tuple(r.ablation_a2tgpo)),
             ("ablation_at2po", tuple(r.ablation_at2po)),
             ("credit_at2po", tuple(r.credit_at2po)), ("beta_method", (r.beta_method,)),
             ("beta_reference_methods", r.beta_reference_methods),
             ("advantage_methods", r.advantage_methods), ("jaccard_method", (r.jaccard_method,))]
    named += [(f"paired[{i}]", pair) for i, pair in enumerate(r.paired)]
    for key, ids in named:
        for m in ids:
            if m not in known:
                near = difflib.get_close_matches(m, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ConfigError(f"{source}: report.{key}: {m!r} is no method id{hint}")
    betas = sorted({c.beta for cs in cells.values() for c in cs if c.method == r.beta_method})
    if betas and format_value(r.beta_main) not in {format_value(b) for b in betas}:
        raise ConfigError(f"{source}: report.beta_main: {format_value(r.beta_main)} is not a β "
                          f"the grid runs {r.beta_method} at "
                          f"({', '.join(format_value(b) for b in betas)})")


def _check_contexts(study: StudyConfig, source: str) -> None:
    """Every backbone's max_model_len within the context its model is made for."""
    for i, b in enumerate(study.backbones):
        cfg = study.backbone(b)
        limit = model_context(cfg, study.toy_backbone.max_position_embeddings)
        if limit is not None and cfg.max_model_len > limit[0]:
            raise ConfigError(f"{source}: backbones[{i}]: {Path(study.backbones_dir)}/{b}.yaml: "
                              f"max_model_len: {cfg.max_model_len} is over the model's context "
                              f"of {limit[0]} tokens ({limit[1]})")


def _check_cells(study: StudyConfig, source: str, cells: dict[str, list[Cell]]) -> None:
    """Every cell's resolved config (TrainConfig's checks, after the cell's overrides), its
    errors led by the study's file."""
    for cell in dict.fromkeys(c for cs in cells.values() for c in cs):
        try:
            resolve_cell(study, cell.path)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def _study_sweeps(study: StudyConfig, source: str
                  ) -> dict[str, tuple[str, SweepConfig, Cell]]:
    from a2tgpo.algo.methods import get_method
    from a2tgpo.grid import normalize_beta
    from a2tgpo.sweep import check_method, load_sweep

    sweeps: dict[str, tuple[str, SweepConfig, Cell]] = {}
    for i, path in enumerate(study.sweeps):
        try:
            sw = load_sweep(path)
            if sw.base.backbone not in study.backbones:
                raise ConfigError(f"{path}: base.backbone: {sw.base.backbone!r} is not one of "
                                  f"the study's backbones ({', '.join(study.backbones)})")
            if sw.base.track not in study.track_names:
                raise ConfigError(f"{path}: base.track: {sw.base.track!r} is not one of the "
                                  f"study's tracks ({', '.join(map(repr, study.track_names))})")
            method = get_method(sw.base.method, study.methods_dir)
            check_method(sw, method, path)
        except ConfigError as e:
            raise ConfigError(f"{source}: sweeps[{i}]: {e}") from None
        if sw.name in sweeps:
            raise ConfigError(f"{source}: sweeps[{i}]: {path}: name {sw.name!r} is also the "
                              f"name of {sweeps[sw.name][0]}")
        sweeps[sw.name] = (path, sw, Cell(sw.base.backbone, sw.base.method,
                                          normalize_beta(method.advantage.beta), sw.base.seed,
                                          sw.base.track))
    return sweeps
