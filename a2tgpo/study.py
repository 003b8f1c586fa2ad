"""The study config (config/config.yaml): the top-level object the DAG runs from.

It nests the stage sections (world, toy_backbone, data, corpus). Snakemake validates the same
file against workflow/schemas/config.schema.yaml, which `a2tgpo config-doc --schema` generates
from these dataclasses; `load_study` adds the strict checks a JSON schema cannot express
(typo suggestions, cross-file references such as backbone ids).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from a2tgpo.cell import Cell
from a2tgpo.config import (
    ConfigError,
    InvalidKey,
    apply_overrides,
    dump_config,
    file_name_error,
    from_dict,
    json_schema,
    name_error,
    option,
    read_yaml,
    refuse_repeats,
)
from a2tgpo.data.corpus import CorpusConfig
from a2tgpo.data.qa import DataConfig
from a2tgpo.data.world import WorldConfig
from a2tgpo.grid import (
    CellSet,
    GridConfig,
    TrackConfig,
    TrainSection,
    cell_config,
    cells_of,
    validate_grid,
)
from a2tgpo.model.backbone import BackboneConfig, load_backbone_config
from a2tgpo.model.fetch import encoder_is_hub_id, is_hub_id
from a2tgpo.model.toy import ToyBackboneConfig
from a2tgpo.report import ReportConfig
from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.tracking import TrackingConfig
from a2tgpo.train.config import SftConfig
from a2tgpo.train.reader import ToyReaderConfig


def _default_grid() -> GridConfig:
    from a2tgpo.algo.methods import METHODS

    return GridConfig(sets={"main": CellSet(methods=tuple(sorted(METHODS)))})


@dataclass(frozen=True)
class CorpusSection:
    """Where the retrieval corpus comes from."""

    source: Literal["world", "hub"] = option(
        "world", "world = the toy world's corpus.jsonl; hub = download (see `download`)."
    )
    download: CorpusConfig = option(
        doc="Hub download settings (used when source is hub).", factory=CorpusConfig
    )


@dataclass(frozen=True)
class EvalSection:
    """How the DAG runs the evaluation jobs (rules evaluate and evaluate_all): their resources,
    and the settings of their rollout engine that change speed and memory, not results."""

    gpus: int = option(
        1, "GPUs per evaluation job when train.device is not cpu (built toy backbones get none); "
        "0 = a CPU job. The job runs one engine: with engine vllm it is tensor parallel over "
        "train.rollout_tp GPUs, so give that many.", ge=0)
    threads: int = option(1, "CPU threads per evaluation job (torch intra-op).", ge=1)
    mem_mb: int | None = option(
        8000, "Memory request of an evaluation job (MB), checked against the job's host memory "
        "plan (`a2tgpo plan`); null = that plan x 1.25.", ge=1)
    runtime_min: int = option(
        60, "Wall-time request of an evaluation job (minutes, SLURM), for one checkpoint on "
        "the cell's test sets.", ge=1)
    runtime_all_min: int | None = option(
        None, "Wall-time request of evaluate_all (train.selection: test_avg, every saved "
        "checkpoint; minutes); null = runtime_min x the checkpoints the cell saves. A job that "
        "runs out keeps the checkpoints it finished, and the rerun continues.", ge=1)
    engine_memory_share: float = option(
        0.9, "engine vllm: share of the GPU's memory the evaluation engine takes (vLLM "
        "gpu_memory_utilization). Replaces train.engine_memory_share, which leaves room for "
        "the trainer: nothing else runs in an evaluation job, so the KV cache can take it "
        "(a train.engine_kv_cache_gb still fixes the KV cache).", gt=0, le=1)
    chunk: int = option(1024, "Questions per rollout call, all test sets pooled (larger = "
                              "larger engine batches).", ge=1)
    max_batch: int | None = option(
        None, "engine hf: sequences per forward pass; null = 32 on CPU, the engine's default "
        "on GPU.", ge=1)


@dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """One study: everything `snakemake` needs to run it."""

    study: str = option(doc="Study name; every output goes under <results_dir>/<study>/.")
    results_dir: str = option("results", "Root directory of everything the DAG writes.")
    cache_dir: str | None = option(
        None, "Caches of the DAG's jobs (the hub's and the datasets library's, e.g. the corpus "
        "converted to Arrow; vLLM's, Triton's and DeepSpeed's compiled kernels); null = "
        "<results_dir>/<study>/cache. Never $HOME: cluster home quotas are small. A variable "
        "already set in the environment (HF_HUB_CACHE, ...) wins.")
    backbones_dir: str = option("config/backbones", "Where <backbone id>.yaml files live.")
    backbones: tuple[str, ...] = option(
        ("toy",), "Backbone ids of the grid (files <backbones_dir>/<id>.yaml)."
    )
    world: WorldConfig = option(doc="The toy world (used when any input comes from it).",
                                factory=WorldConfig)
    toy_backbone: ToyBackboneConfig = option(
        doc="Sizes of the toy backbone (built when a backbone has needs_build: true).",
        factory=ToyBackboneConfig,
    )
    toy_reader: ToyReaderConfig = option(
        doc="The toy reader (`a2tgpo toy-reader`, a2tgpo/train/reader.py): a toy backbone "
        "pretrained to read on other worlds; built by hand, used through a backbone file.",
        factory=ToyReaderConfig,
    )
    data: DataConfig = option(doc="QA datasets: training sets, dev holdout, test sets.")
    corpus: CorpusSection = option(doc="Retrieval corpus source.", factory=CorpusSection)
    retrieval: RetrievalConfig = option(
        doc="The search tool: retriever, encoder, index, HTTP mode.", factory=RetrievalConfig
    )
    sft: SftConfig = option(
        doc="Warm-start of built (toy) backbones on scripted demonstrations.", factory=SftConfig
    )
    methods_dir: str = option("config/methods", "Where <method id>.yaml files live.")
    tracks: dict[str, TrackConfig] = option(
        doc="Training tracks (one model each, e.g. multi_hop / single_hop as in the papers); "
        "empty = one model trained on all training sets and tested on all test sets.",
        factory=dict)
    grid: GridConfig = option(doc="Named sets of cells (backbone x method x beta x seed).",
                              factory=_default_grid)
    train: TrainSection = option(doc="Settings shared by every cell's training run.",
                                 factory=TrainSection)
    eval: EvalSection = option(doc="Evaluation jobs: resources and engine memory.",
                               factory=EvalSection)
    tracking: TrackingConfig = option(doc="metrics.jsonl + MLflow (one run per cell).",
                                      factory=TrackingConfig)
    report: ReportConfig = option(doc="Tables and plots: rows, columns, labels.",
                                  factory=ReportConfig)
    sweeps: tuple[str, ...] = option(
        (), "Optuna sweep configs (config/sweeps/<name>.yaml); each is a target of its own, "
        "`snakemake sweep_<name>`, not part of the default target.")

    def __post_init__(self) -> None:
        if error := name_error(self.study):
            raise InvalidKey("study", error)
        if not self.backbones:
            raise ValueError("backbones must name at least one backbone")
        refuse_repeats("backbones", self.backbones)

    @property
    def root(self) -> Path:
        return Path(self.results_dir) / self.study

    @property
    def track_names(self) -> tuple[str, ...]:
        """The tracks cells are made for; ("",) = the single implicit track."""
        return tuple(self.tracks) or ("",)

    def track_data(self, track: str) -> DataConfig:
        """The data section one track prepares: its training and test sources only."""
        if not track:
            return self.data
        t = self.tracks[track]
        return dataclasses.replace(
            self.data, train=tuple(s for s in self.data.train if s.name in t.train),
            test=tuple(s for s in self.data.test if s.name in t.test))

    def backbone(self, backbone_id: str) -> BackboneConfig:
        return _backbone_file(Path(self.backbones_dir) / f"{backbone_id}.yaml")


def _backbone_file(path: Path) -> BackboneConfig:
    """load_backbone_config, read once per file version (the DAG asks for every cell)."""
    stat = path.stat()
    return _cached_backbone(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=64)
def _cached_backbone(path: str, mtime_ns: int, size: int) -> BackboneConfig:
    return load_backbone_config(path)


def study_schema() -> dict:
    """The JSON schema Snakemake validates config/config.yaml with (generated; not hand-edited)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "description": "a2tgpo study config; generated by `a2tgpo config-doc --schema`",
            **json_schema(StudyConfig)}


def study_from_dict(data: dict, source: str) -> StudyConfig:
    """Strict validation of an already-parsed study config (Snakemake's `config` dict)."""
    study = from_dict(StudyConfig, data, source=source)
    for key in ("results_dir", "cache_dir", "backbones_dir", "methods_dir"):
        if getattr(study, key) == "":
            raise ConfigError(f"{source}: {key}: an empty path (write . for this folder)")
    for key in ("results_dir", "cache_dir"):
        if error := _folder_error(getattr(study, key)):
            raise ConfigError(f"{source}: {key}: {error}")
    # a method file in a folder that does not exist would silently be the built-in table's
    if not Path(study.methods_dir).is_dir():
        raise ConfigError(f"{source}: methods_dir: no such folder: {study.methods_dir}")
    if error := _folder_error(study.root):
        raise ConfigError(f"{source}: study: {error} (<results_dir>/<study>)")
    for i, b in enumerate(study.backbones):
        if error := file_name_error(b):  # also <root>/models/<id>
            raise ConfigError(f"{source}: backbones[{i}]: {error}")
        path = Path(study.backbones_dir) / f"{b}.yaml"
        if not path.exists():
            raise ConfigError(f"{source}: backbones[{i}]: no backbone file {path}")
        cfg = load_backbone_config(path)
        if cfg.id != b:
            raise ConfigError(f"{path}: id: {cfg.id!r} does not match the file name {b!r}")
    for role in ("train", "test"):
        for i, s in enumerate(getattr(study.data, role)):
            if error := _data_repo_error(study, s):
                raise ConfigError(f"{source}: data.{role}[{i}].{error}")
    train_names = {s.name for s in study.data.train}
    test_names = {s.name for s in study.data.test}
    for name in study.train.regimes:
        if error := name_error(name):  # a path component of its cells
            raise ConfigError(f"{source}: train.regimes.{name}: {error}")
    for name, track in study.tracks.items():
        if error := name_error(name):
            raise ConfigError(f"{source}: tracks.{name}: {error}")
        for key, names, known in (("train", track.train, train_names),
                                  ("test", track.test, test_names)):
            if not names:
                raise ConfigError(f"{source}: tracks.{name}.{key}: name at least one source")
            for i, n in enumerate(names):
                if n not in known:
                    raise ConfigError(f"{source}: tracks.{name}.{key}[{i}]: no data.{key} "
                                      f"source named {n!r} ({', '.join(sorted(known))})")
    validate_grid(study.grid, study.backbones, study.methods_dir, source, study.track_names,
                  tuple(study.train.regimes))
    train, gpus = study.train, study.eval.gpus
    need = train.rollout_tp if train.engine == "vllm" else 1
    if train.device != "cpu" and gpus and gpus != need:
        # one engine per job: fewer GPUs fail at start-up, more sit idle
        raise ConfigError(f"{source}: eval.gpus: {gpus}, but an evaluation job runs one "
                          f"{train.engine} engine on {need} GPU(s)"
                          + (" (train.rollout_tp)" if train.engine == "vllm" else ""))
    return study


def _data_repo_error(study: StudyConfig, src) -> str | None:
    """Why `prepare-data` could not read data source `src` ("<key>: <why>"; None: it may),
    found without the network. qa.resolve_file reads a repo that exists or starts with /, . or
    ~ as a local folder, anything else as a hub dataset id; a repo under <root>/world is the
    toy world's QA folder, which the DAG writes before it prepares data (common.smk
    uses_world), so its subset and split must be ones the world writes."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    world = f"{study.root}/world"
    if src.repo.startswith(world):
        qa = {s.name: s.splits for s in study.world.qa_sets}
        if src.repo.rstrip("/") != f"{world}/qa" or src.loader != "flashrag":
            return (f"repo: {src.repo}: the toy world's questions are read from {world}/qa "
                    "with loader flashrag")
        if src.subset not in qa:
            return (f"subset: {src.subset!r} is not one of the world's qa_sets "
                    f"({', '.join(qa)})")
        splits = ("test", "dev") if src.split == "auto" else (src.split,)
        written = [s for s in splits if s in qa[src.subset]]  # auto: test if written, else dev
        if not written:
            return (f"split: world.qa_sets {src.subset} has no split "
                    f"{' or '.join(splits)} ({', '.join(qa[src.subset])})")
        if qa[src.subset][written[0]] == 0:
            return (f"split: world.qa_sets {src.subset} writes no question to its "
                    f"{written[0]} split (splits.{written[0]}: 0)")
        return None
    local = Path(src.repo).expanduser()
    if local.exists():
        return None if local.is_dir() else f"repo: {src.repo} is a file, not a folder"
    if src.repo.startswith(("/", ".", "~")):
        return f"repo: no such local folder: {src.repo}"
    try:
        validate_repo_id(src.repo)
    except HFValidationError:
        # the toy config's QA folder, results_dir changed and the repos not (or a typo)
        hint = (f"; this study's toy world writes its questions to {world}/qa"
                if src.repo.rstrip("/").endswith("/world/qa") else "")
        return (f"repo: {src.repo!r} is neither a local folder nor a hub dataset id "
                f"(owner/name){hint}")
    return None


def _folder_error(path: str | Path | None) -> str | None:
    """Why the DAG could not write into folder `path` (None: it can, or `path` is None): it,
    or the nearest of its parents that exists, is not a folder."""
    if path is None:
        return None
    for part in (Path(path), *Path(path).parents):
        if part.exists():
            return None if part.is_dir() else f"{part} exists and is not a folder"
    return None


def load_study(path: str | Path, overrides=()) -> StudyConfig:
    overrides = list(overrides)
    data = apply_overrides(read_yaml(path), overrides)
    source = str(path) + (f" (with overrides {' '.join(overrides)})" if overrides else "")
    return study_from_dict(data, source)


def section(study: StudyConfig, dotted: str) -> Any:
    """One section as jobs read it (the retrieval section: `job_retrieval`)."""
    node: Any = study
    for part in dotted.split("."):
        if not hasattr(node, "__dataclass_fields__") or part not in node.__dataclass_fields__:
            raise ConfigError(f"no config section {dotted!r}")
        node = job_retrieval(study) if node is study and part == "retrieval" else getattr(
            node, part)
    return node


def write_section(path: str | Path, overrides, dotted: str, output: str | Path) -> None:
    """Validate the study config and write one section, defaults filled in, to `output`."""
    dump_config(section(load_study(path, overrides), dotted), output)


# --------------------------------------------------------------------------------------------
# the study's cells and where their inputs live (the workflow's rules read the same functions)


def data_dir(study: StudyConfig, track: str) -> str:
    """Prepared data of a track: <root>/data (no tracks) or <root>/data/<track>."""
    return f"{study.root}/data/{track}" if track else f"{study.root}/data"


def corpus_file(study: StudyConfig) -> str:
    """The retrieval corpus the index rules read (wiki-18 format JSONL, maybe gzipped)."""
    if study.corpus.source == "world":
        return f"{study.root}/world/corpus.jsonl"
    return f"{study.root}/corpus/{study.corpus.download.filename}"


def index_file(study: StudyConfig) -> str:
    """The faiss index retrievers load: prebuilt (checked by rule check_index) or built by
    rule build_index."""
    return study.retrieval.index.prebuilt or f"{study.root}/index/dense.faiss"


def model_dir(study: StudyConfig, backbone_id: str) -> str:
    """Where the DAG fetches a released backbone given by hub id (a2tgpo/model/fetch.py)."""
    return f"{study.root}/models/{backbone_id}"


def encoder_dir(study: StudyConfig) -> str:
    """Where the DAG fetches a retrieval encoder given by hub id (rule fetch_encoder)."""
    return f"{study.root}/models/encoder"


def job_retrieval(study: StudyConfig):
    """The retrieval section jobs run with: an encoder given by hub id replaced by its fetched
    folder (jobs run with the hub offline), which is at the pinned revision already."""
    enc = study.retrieval.encoder
    if not encoder_is_hub_id(enc.model):
        return study.retrieval
    return dataclasses.replace(study.retrieval, encoder=dataclasses.replace(
        enc, model=encoder_dir(study), revision=None))


def policy_dir(study: StudyConfig, backbone_id: str) -> str:
    """Where a cell's starting policy lives: the warm-started model for built (toy) backbones,
    the fetched folder for hub ids, the backbone's own local directory otherwise."""
    cfg = study.backbone(backbone_id)
    if cfg.needs_build:
        return f"{study.root}/sft"
    return model_dir(study, backbone_id) if is_hub_id(cfg) else cfg.path


def study_cache(study: StudyConfig) -> Path:
    """The study's cache folder (StudyConfig.cache_dir), absolute."""
    return Path(study.cache_dir or f"{study.root}/cache").absolute()


def cache_env(study: StudyConfig) -> dict[str, str]:
    """The cache variables the DAG sets for its jobs (StudyConfig.cache_dir). HF_HOME itself is
    left alone: the hub token lives there."""
    root = study_cache(study)
    return {"HF_HUB_CACHE": str(root / "huggingface" / "hub"),
            "HF_XET_CACHE": str(root / "huggingface" / "xet"),
            "HF_ASSETS_CACHE": str(root / "huggingface" / "assets"),
            "HF_DATASETS_CACHE": str(root / "huggingface" / "datasets"),
            "XDG_CACHE_HOME": str(root),
            "VLLM_CACHE_ROOT": str(root / "vllm"),
            "TRITON_CACHE_DIR": str(root / "triton"),
            "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")}


def study_cells(study: StudyConfig) -> dict[str, list[Cell]]:
    """The cells of every grid set, by set name, in a stable order."""
    betas = validate_grid(study.grid, study.backbones, study.methods_dir, "config",
                          study.track_names, tuple(study.train.regimes))
    return {name: cells_of(study.grid, name, study.backbones, betas, study.track_names)
            for name in study.grid.sets}


def resolve_cell(study: StudyConfig, path: str):
    """The resolved TrainConfig of the cell at `path` (what `a2tgpo train` reads)."""
    cell = Cell.parse(path)
    released = study.backbone(cell.backbone)
    # a fetched folder is at the pinned revision already (its fetch.json records it)
    backbone = dataclasses.replace(
        released, path=policy_dir(study, cell.backbone),
        revision=None if is_hub_id(released) else released.revision)
    return cell_config(
        cell, study=study.study, results_root=str(study.root), backbone=backbone,
        train=study.train, methods_dir=study.methods_dir, retrieval=job_retrieval(study),
        tracking=study.tracking, train_file=f"{data_dir(study, cell.data)}/train.parquet",
        dev_file=f"{data_dir(study, cell.data)}/dev.parquet", corpus=corpus_file(study),
        index=index_file(study))
