"""The toy reader (`a2tgpo toy-reader`): a toy backbone that reads what it retrieves, built on
worlds the study never uses, so that RL on the study's questions starts from a policy whose
skill carries over to questions it has not seen.

Why it exists. A toy backbone warm-started on the study's own world memorises that world: the
default one scored EM 0.92 on the questions its demonstrations covered and 0.45 on held-out
ones, and RL then learned per-question answers that did not carry to the dev questions (dev EM
within 0.42-0.50 of the warm start's 0.45 whatever the method: docs/toy-lab.md, 2026-11 to 12-03).
A real search agent starts from a model pretrained elsewhere that already reads; this is the
toy's version of that model, trained once and used by a study the way a released backbone is:
a backbone file whose `path` is the reader's folder (needs_build: false, so no warm start).

Recipe (each step's config key in brackets):
  1. Generate `worlds` toy worlds with seeds k × `seed_stride`, k = 1..worlds, of the sizes in
     `world` [toy_reader.world]. A study must not use one of those seeds
     (`check_reader_worlds`): its questions would then be memorised, not read.
  2. Train the byte-level BPE tokenizer on their texts and build the Qwen3 model
     [toy_reader.backbone].
  3. Copy-pretrain the model on repeated random token sequences [toy_reader.backbone.copy]:
     the induction skill that copies names it never saw.
  4. Write the oracle's demonstrations for every question of every world, with BM25 retrieval
     over that world's corpus and the study's agent format (a share deliberately imperfect)
     [toy_reader.sft.imperfect_fraction].
  5. Fine-tune on their action tokens [toy_reader.sft].
  6. Save model and tokenizer (`save_pretrained`) and `a2tgpo_reader.json`: the config, the
     world seeds, the copy accuracy, the SFT history and the seconds per step.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from a2tgpo.config import ConfigError, option, to_dict
from a2tgpo.data.world import WorldConfig, write_world
from a2tgpo.io import atomic_path, atomic_write_json
from a2tgpo.model.copy_pretrain import CopyPretrainConfig
from a2tgpo.model.toy import ToyBackboneConfig
from a2tgpo.train.config import SftConfig

log = logging.getLogger(__name__)

READER_FILE = "a2tgpo_reader.json"


def _reader_backbone() -> ToyBackboneConfig:
    # vocabulary 1024: the other worlds' names are pieces the study's names are also made of;
    # copy sequences of 6-12 tokens: 2 of 2 seeds reached held-out repeat accuracy 0.8 within
    # 1,500 updates, against 0 of 3 with 6-24 tokens by 2,500 (measured 2026-12-03)
    return ToyBackboneConfig(vocab_size=1024, copy=CopyPretrainConfig(steps=3000,
                                                                      max_length=12))


def _reader_sft() -> SftConfig:
    return SftConfig(epochs=2, lr=1e-3, batch_size=8, log_every=50)


@dataclass(frozen=True)
class ToyReaderConfig:
    """The toy reader (`a2tgpo toy-reader`): a toy backbone pretrained on other toy worlds."""

    worlds: int = option(6, "How many pretraining worlds.", ge=1)
    seed_stride: int = option(1000, "World k (1..worlds) has seed k × seed_stride.", ge=1)
    world: WorldConfig = option(
        doc="Sizes of each pretraining world (its `seed` is replaced by k × seed_stride).",
        factory=WorldConfig)
    backbone: ToyBackboneConfig = option(
        doc="Tokenizer, model sizes and copy pretraining of the reader.",
        factory=_reader_backbone)
    sft: SftConfig = option(
        doc="Fine-tuning on the pretraining worlds' demonstrations (`datasets`, `max_questions` "
        "and `kind_draws` are not used: every question of every world is demonstrated once).",
        factory=_reader_sft)

    def world_seeds(self) -> list[int]:
        return [k * self.seed_stride for k in range(1, self.worlds + 1)]


def reader_world_seeds(model_dir: str | Path) -> list[int] | None:
    """The pretraining world seeds a reader at `model_dir` records; None when it is not one."""
    path = Path(model_dir) / READER_FILE
    if not path.exists():
        return None
    return list(json.loads(path.read_text())["world_seeds"])


def check_reader_worlds(model_dir: str | Path, study_world_seed: int, where: str) -> None:
    """A study on a world the reader was pretrained on would measure memory, not reading."""
    seeds = reader_world_seeds(model_dir)
    if seeds is not None and study_world_seed in seeds:
        raise ConfigError(
            f"{where}: world.seed {study_world_seed} is one of the worlds the reader at "
            f"{model_dir} was pretrained on ({seeds}); choose another world seed")


def build_reader(cfg: ToyReaderConfig, work_dir: str | Path, out_dir: str | Path) -> dict:
    """Steps 1-6 of the module's recipe; the worlds go under `work_dir`, the reader to
    `out_dir` (atomically). Deterministic on CPU given the config."""
    from a2tgpo.model.copy_pretrain import copy_pretrain
    from a2tgpo.model.toy import build_model, build_tokenizer, training_texts
    from a2tgpo.retrieval.retriever import RetrievalConfig, build_retriever
    from a2tgpo.rollout.agent import AgentConfig, SearchTool
    from a2tgpo.train.sft import demo_stats, load_oracle_questions, train_sft, write_demonstrations

    seconds: dict[str, float] = {}
    t = time.perf_counter()
    # 1. the pretraining worlds (kept: a rerun reuses complete ones)
    worlds = []
    for seed in cfg.world_seeds():
        d = Path(work_dir) / f"world-{seed}"
        if not (d / "summary.json").exists():
            write_world(dataclasses.replace(cfg.world, seed=seed), d)
        worlds.append(d)
    seconds["worlds"] = time.perf_counter() - t
    # 2. tokenizer and model
    t = time.perf_counter()
    tok = build_tokenizer(cfg.backbone, itertools.chain.from_iterable(
        training_texts(d) for d in worlds))
    model = build_model(cfg.backbone, tok)
    # 3. copy pretraining (raises CopyPretrainFailed below its min_accuracy)
    copy = copy_pretrain(model, tok, cfg.backbone.copy)
    seconds["copy"] = time.perf_counter() - t
    # 4. demonstrations, each world's searched with its own BM25 index
    t = time.perf_counter()
    agent, search = AgentConfig(), RetrievalConfig(retriever="bm25")
    demos, per_world = [], {}
    for k, d in enumerate(worlds, start=1):
        questions = load_oracle_questions(
            d, [(p.parent.name, p.stem) for p in sorted((d / "qa").glob("*/*.jsonl"))])
        retriever = build_retriever(search, d / "corpus.jsonl", None)
        try:
            world_demos = write_demonstrations(
                questions, SearchTool(retriever, tok, agent, search), agent,
                imperfect_fraction=cfg.sft.imperfect_fraction, seed=cfg.sft.seed + k,
                early_answer_fraction=cfg.sft.early_answer_fraction,
                guess_fraction=cfg.sft.guess_fraction, plan=cfg.sft.plan_thought)
        finally:
            retriever.close()
        per_world[d.name] = demo_stats(world_demos)
        log.info("toy reader: %s: %d demonstrations, %.1f%% correct", d.name,
                 len(world_demos), 100 * per_world[d.name]["correct"])
        demos += world_demos
    seconds["demonstrations"] = time.perf_counter() - t
    # 5. fine-tuning on the action tokens
    t = time.perf_counter()
    history = train_sft(model, demos, cfg.sft, tok.pad_token_id)
    seconds["sft"] = time.perf_counter() - t
    # 6. save
    summary = {
        "config": to_dict(cfg),
        "world_seeds": cfg.world_seeds(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_vocab": len(tok),
        "copy_pretraining": copy,
        "demonstrations": {"total": demo_stats(demos), "per_world": per_world},
        "sft": history,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    with atomic_path(out_dir, directory=True) as tmp:
        tok.save_pretrained(tmp)
        model.save_pretrained(tmp)
        atomic_write_json(tmp / READER_FILE, summary)
    log.info("toy reader: %s parameters, copy accuracy %.3f, SFT final loss %.4f, %.0f s -> %s",
             f"{summary['parameters']:,}", copy.get("heldout_accuracy", float("nan")),
             history["final_loss"], sum(seconds.values()), out_dir)
    return summary
