"""The policy's episodes as training, validation and evaluation all run them: the engine, the
method's rollout shape, and scoring by the method's reward.

Validation (training) and test evaluation call the same `rollout(..., greedy=True)` and
`score(..., training=False)` with the same `GREEDY_SEED`, so a dev EM and a test EM are one
measurement. Every score, training rewards included, goes through `score_trajectory`: the
answer is read from the policy's own tokens of the last turn, never from observations
(a2tgpo/algo/rewards.py, "What is read").

The prompt budget (`prompt_budget`) is what the backbone's context leaves after the response:
`backbone.max_model_len - rollout.max_response_tokens` (the papers: 8192 - 6192 = 2000). A
question whose prompt is longer cannot be rolled out within the context; `prepare-data` bounds
questions by characters (`data.max_question_chars`) before any tokenizer is known, and the exact
token check runs where it is: training refuses such a question (`load_questions`), evaluation
records it as failed and goes on (a2tgpo/eval/evaluate.py).

Every function reads the run's TrainConfig (backbone, method, rollout and engine settings), so
this module sits with training, above a2tgpo/rollout/, whose parts it puts together.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from a2tgpo.algo.rewards import Response, Score, score_response
from a2tgpo.data import prompts
from a2tgpo.data.qa import load_split
from a2tgpo.model.backbone import chat_template_kwargs
from a2tgpo.rollout import trees
from a2tgpo.rollout.agent import Question, SearchTool, rollout_chains
from a2tgpo.rollout.hf_engine import HfEngine
from a2tgpo.rollout.trajectory import Trajectory
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


def load_questions(path: str | Path, limit: int = 0, *, cfg: TrainConfig | None = None,
                   tok=None) -> list[Question]:
    """The questions of a prepared split, in file order; the first `limit` (0 = all).

    With `cfg` and `tok`, a question whose prompt exceeds the prompt budget is refused
    (ValueError naming the file, row and id): training cannot roll it out.
    """
    rows = load_split(path)
    qs = [question_of(r) for r in (rows[:limit] if limit else rows)]
    if cfg is not None and tok is not None:
        budget = prompt_budget(cfg)
        for i, (q, n) in enumerate(zip(qs, prompt_lengths(cfg, tok, qs), strict=True)):
            if n > budget:
                raise ValueError(f"{path}: row {i} (id {q.id!r}): {too_long(cfg, n)}; lower "
                                 "data.max_question_chars and prepare the data again")
    return qs


def prompt_budget(cfg: TrainConfig) -> int:
    """Prompt tokens a question may take: `backbone.max_model_len` less
    `rollout.max_response_tokens` (see the module docstring)."""
    budget = cfg.backbone.max_model_len - cfg.rollout.max_response_tokens
    if budget < 1:
        raise ValueError(f"backbone.max_model_len ({cfg.backbone.max_model_len}) leaves no room "
                         f"for a prompt after rollout.max_response_tokens "
                         f"({cfg.rollout.max_response_tokens})")
    return budget


def too_long(cfg: TrainConfig, n: int) -> str:
    """Why a prompt of `n` tokens is refused, with the keys that set the budget."""
    return (f"its prompt is {n} tokens, over the prompt budget of {prompt_budget(cfg)} "
            f"(backbone.max_model_len {cfg.backbone.max_model_len} - "
            f"rollout.max_response_tokens {cfg.rollout.max_response_tokens})")


def prompt_lengths(cfg: TrainConfig, tok, questions: list[Question]) -> list[int]:
    """Each question's prompt length in tokens, exactly as `agent.prompt_ids` builds the prompt.

    The papers' training sets hold ~170k questions, so the fixed part of the prompt is counted
    once (`_question_slot`): only the text around the question, between the added tokens that
    bound it, is encoded per question. Where the template does not allow that, every prompt is
    rendered and encoded whole.
    """
    if not questions:
        return []
    style, chat = cfg.rollout.prompt_style, chat_template_kwargs(cfg.backbone)

    def render(question: str) -> str:
        return tok.apply_chat_template(prompts.build_messages(question, style),
                                       add_generation_prompt=True, tokenize=False, **chat)

    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]

    if (slot := _question_slot(tok, render, count)) is None:
        return count([render(q.question) for q in questions])
    fixed, left, right = slot
    return [fixed + n for n in count([left + prompts.normalise_question(q.question) + right
                                      for q in questions])]


def _question_slot(tok, render, count) -> tuple[int, str, str] | None:
    """(fixed, left, right) such that a question's prompt has `fixed` + the tokens of
    `left + q + right` (q normalised), or None.

    A tokenizer splits its input at added tokens (`<|im_start|>`, ...) and encodes the text
    between them on its own, so what lies outside the added tokens around the question counts
    the same whatever the question. `left` runs from the last added token before the question,
    `right` to the end of the first one after it (kept, so that their whitespace stripping
    applies as in the whole prompt). Checked on two probe questions: the template must place
    the question verbatim, and the split must count both probes' prompts exactly.
    """
    probes = ("\x01a2tgpo probe\x01?", "\x01a2tgpo probe, <answer> a longer one\x01?")
    whole = [render(p) for p in probes]
    before, found, after = whole[0].partition(probes[0])
    if not found or whole[1] != before + probes[1] + after:
        return None
    added = [t for t in tok.get_added_vocab() if t]
    lefts = [(before.rfind(t), -len(t)) for t in added if t in before]
    rights = [(after.find(t), -len(t), t) for t in added if t in after]
    if not lefts or not rights:
        return None
    start, _ = max(lefts)
    end, _, token = min(rights)
    left, right = before[start:], after[:end + len(token)]
    n_whole = count(whole)
    n_slot = count([left + p + right for p in probes])
    fixed = n_whole[0] - n_slot[0]
    return (fixed, left, right) if n_whole[1] - n_slot[1] == fixed else None


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
        return HfEngine(model, tok, max_model_len=cfg.backbone.max_model_len,
                        fast_path=cfg.backbone.fast_path)
    from a2tgpo.rollout.vllm_engine import VllmEngine  # optional, GPU nodes

    return VllmEngine(cfg.backbone.path, max_model_len=cfg.backbone.max_model_len,
                      seed=cfg.seed, gpu_memory_utilization=cfg.engine_memory_share,
                      enable_sleep_mode=cfg.engine_sleep, devices=devices,
                      kv_cache_space_gb=cfg.engine_kv_cache_gb, weight_sync=cfg.weight_sync,
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


def response_of(tok, traj: Trajectory) -> Response:
    """The trajectory as the scorer reads it: per turn, its sampled ids and its observation ids,
    each decoded on its own without special tokens (ids are never re-encoded)."""
    return Response(tuple((tok.decode(t.action_ids, skip_special_tokens=True),
                           tok.decode(t.obs_ids, skip_special_tokens=True))
                          for t in traj.turns))


def score_trajectory(tok, traj: Trajectory, style: prompts.PromptStyle, *, training: bool
                     ) -> Score:
    """The one scorer of training rewards, validation and evaluation: the answer from the
    policy's tokens of the last turn only, the format from the policy's tokens and the
    observations' envelopes (a2tgpo/algo/rewards.py, "What is read")."""
    return score_response(response_of(tok, traj), list(traj.golden_answers), style,
                          training=training)


def score(cfg: TrainConfig, tok, trajs: list[Trajectory], *, training: bool
          ) -> list[Trajectory]:
    """Each trajectory with its reward and `extra` em, f1, format_ok and the extracted answer
    (the method's reward; "search_r1" trains on plain EM, no format reward)."""
    out = []
    for t in trajs:
        s = score_trajectory(tok, t, cfg.method.answer_style, training=training)
        reward = s.em if cfg.method.reward == "search_r1" and training else s.reward
        out.append(replace(t, reward=reward, extra={**t.extra, "em": s.em, "f1": s.f1,
                                                   "format_ok": s.format_ok,
                                                   "answer": s.answer}))
    return out
