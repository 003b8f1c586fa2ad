# Config validation (before any job starts), study paths and the target list.

import sys
from pathlib import Path

from snakemake.utils import validate

# 1. the JSON schema (generated from the dataclasses by `a2tgpo config-doc --schema`)
validate(config, "../schemas/config.schema.yaml")

# 2. the strict loader: the same dataclasses, plus cross-file checks (backbone files exist)
from a2tgpo.config import ConfigError
from a2tgpo.study import study_from_dict

try:
    STUDY = study_from_dict(config, source="config (config/config.yaml + --configfile/--config)")
except ConfigError as e:
    sys.exit(f"invalid config: {e}")

R = str(STUDY.root)  # results/<study>
BACKBONES = {b: STUDY.backbone(b) for b in STUDY.backbones}
TOY_BACKBONES = {b: cfg for b, cfg in BACKBONES.items() if cfg.needs_build}
if len({cfg.path for cfg in TOY_BACKBONES.values()}) > 1:
    sys.exit("invalid config: all built (toy) backbones must share one path")


def uses_world():
    """The toy world is built when the corpus, a dataset or a backbone comes from it."""
    world_dir = f"{R}/world"
    sources = list(STUDY.data.train) + list(STUDY.data.test)
    return (
        STUDY.corpus.source == "world"
        or bool(TOY_BACKBONES)
        or any(s.repo.startswith(world_dir) for s in sources)
    )


def corpus_file():
    """The retrieval corpus the index rules read (wiki-18 format JSONL, maybe gzipped)."""
    if STUDY.corpus.source == "world":
        return f"{R}/world/corpus.jsonl"
    return f"{R}/corpus/{STUDY.corpus.download.filename}"


def all_targets():
    targets = [f"{R}/data/summary.json", corpus_file(), f"{R}/index/check.json"]
    if uses_world():
        targets += [f"{R}/world/summary.json", f"{R}/retrieval/recall.json"]
    targets += [f"{cfg.path}/config.json" for cfg in TOY_BACKBONES.values()]
    if TOY_BACKBONES:
        targets.append(f"{R}/sft/config.json")
    return targets


wildcard_constraints:
    section=r"[a-z_]+(\.[a-z_]+)*",
