"""The policy's episodes as training, validation and evaluation all run them: the engine, the
method's rollout shape, and scoring by the method's reward.

Validation (training) and test evaluation call the same `rollout(..., greedy=True)` and
`score(..., training=False)` with the same `GREEDY_SEED`, so a dev EM and a test EM are one
measurement.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from a2tgpo.algo.rewards import score_response
from a2tgpo.data.qa import load_split
from a2tgpo.model.backbone import chat_template_kwargs
from a2tgpo.rollout import trees
from a2tgpo.rollout.agent import Question, SearchTool, rollout_chains
from a2tgpo.rollout.hf_engine import HfEngine
from a2tgpo.rollout.trajectory import Trajectory

if TYPE_CHECKING:  # the config holds rollout settings: a type-only import avoids a cycle
    from a2tgpo.train.config import TrainConfig

# the seed of greedy validation and evaluation rollouts (greedy decoding draws nothing from it;
# one constant keeps them the same computation)
GREEDY_SEED = 10_000_019

_TREE_ROLLOUTS = {"tree_random": trees.rollout_tree_grpo, "tree_entropy": trees.rollout_at2po,
                  "aepo": trees.rollout_aepo}


def question_of(row: dict) -> Question:
    """A prepared split's row (`a2tgpo.data.qa.load_split`) as the agent's question."""
    return Question(row["id"], row["question"], tuple(row["golden_answers"]),
                    row.get("hop_type"), row.get("hops"))


def load_questions(path: str | Path, limit: int = 0) -> list[Question]:
    """The questions of a prepared split, in file order; the first `limit` (0 = all)."""
    rows = load_split(path)
    return [question_of(r) for r in (rows[:limit] if limit else rows)]


def resolve_device(device: str) -> str:
    """A config's torch device: "auto" is cuda when a GPU is visible, else cpu."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_engine(cfg: TrainConfig, model, tok, devices: tuple[int, ...] | None = None):
    """The rollout engine of `cfg.engine`: the hf engine samples from `model` itself; vLLM
    loads the backbone, on the local GPUs `devices` (None: as vLLM picks them; tensor parallel
    over `cfg.rollout_tp` of them), and receives weights by `update_weights`."""
    if cfg.engine == "hf":
        return HfEngine(model, tok, max_model_len=cfg.backbone.max_model_len)
    from a2tgpo.rollout.vllm_engine import VllmEngine  # optional, GPU nodes

    return VllmEngine(cfg.backbone.path, max_model_len=cfg.backbone.max_model_len,
                      seed=cfg.seed, gpu_memory_utilization=cfg.engine_memory_share,
                      enable_sleep_mode=cfg.engine_sleep, devices=devices,
                      kv_cache_space_gb=cfg.engine_kv_cache_gb,
                      tensor_parallel_size=cfg.rollout_tp)


def search_tool(cfg: TrainConfig, retriever, tok) -> SearchTool:
    """The search tool of `cfg`'s rollouts (training, validation, evaluation): the rollout
    section's prompt style and observation budget, the retrieval section's passages."""
    return SearchTool(retriever, tok, cfg.rollout, cfg.retrieval)


def rollout(cfg: TrainConfig, questions: list[Question], engine, tool: SearchTool, *,
            seed: int, greedy: bool = False) -> list[Trajectory]:
    """The method's rollout shape over `questions` (greedy validation is always chains)."""
    shape = cfg.method.rollout
    chat = chat_template_kwargs(cfg.backbone)
    if greedy or shape.shape == "chains":
        return rollout_chains(questions, 1 if greedy else shape.n, engine, tool, cfg.rollout,
                              seed=seed, greedy=greedy, chat_kwargs=chat)
    return _TREE_ROLLOUTS[shape.shape](questions, engine, tool, cfg.rollout, shape, seed=seed,
                                       chat_kwargs=chat)


def score(cfg: TrainConfig, tok, trajs: list[Trajectory], *, training: bool
          ) -> list[Trajectory]:
    """Each trajectory with its reward and `extra` em, f1, format_ok and the extracted answer
    (the method's reward; "search_r1" trains on plain EM, no format reward)."""
    out = []
    for t in trajs:
        s = score_response(tok.decode(t.response_ids(), skip_special_tokens=True),
                           list(t.golden_answers), cfg.method.answer_style,
                           training=training)
        reward = s.em if cfg.method.reward == "search_r1" and training else s.reward
        out.append(replace(t, reward=reward, extra={**t.extra, "em": s.em, "f1": s.f1,
                                                   "format_ok": s.format_ok,
                                                   "answer": s.answer}))
    return out
