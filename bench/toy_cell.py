"""What the rollout benchmarks load from one finished toy cell (`./run snakemake` first): its
config, the backbone it starts from, its search tool and the first dev questions. One thread,
as the toy's jobs run. Imported by bench/rollout_prefix.py and bench/decode.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

DEFAULT_CELL = "results/toy/runs/backbone~toy_reader/data~multi_hop/method~grpo/beta~0/seed~1"


def add_cell_args(ap: argparse.ArgumentParser, questions: int) -> None:
    ap.add_argument("--cell", default=DEFAULT_CELL)
    ap.add_argument("--questions", type=int, default=questions)
    ap.add_argument("--reps", type=int, default=3)


def load_cell(cell: str, questions: int):
    """-> (TrainConfig, tokenizer, model, SearchTool, the first `questions` dev questions)."""
    from a2tgpo.config import load_config
    from a2tgpo.model.backbone import load_model, load_tokenizer
    from a2tgpo.retrieval.retriever import build_retriever
    from a2tgpo.train.config import TrainConfig
    from a2tgpo.train.episodes import load_questions, search_tool

    torch.set_num_threads(1)
    cfg = load_config(TrainConfig, Path(cell) / "config.yaml")
    tok = load_tokenizer(cfg.backbone)
    model = load_model(cfg.backbone)
    tool = search_tool(cfg, build_retriever(cfg.retrieval, cfg.corpus, cfg.index), tok)
    return cfg, tok, model, tool, load_questions(cfg.dev_file, questions)
