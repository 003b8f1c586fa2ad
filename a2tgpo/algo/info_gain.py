"""Information gain per tool-call turn from teacher-forced gold-answer log-probabilities.

IGPO (arXiv 2510.14967) as restated by A2TGPO §3 Eq. 2–3: the value after turn t is the
geometric-mean probability of the gold answer's tokens given the question and the trajectory
through turn t's observation, v_t = exp((1/L) Σ_j log π(a_j | q, τ_≤t, a_<j)); the IG of turn t
is v_t − v_{t−1}, the first against the question alone (v_0). Computing the log-probabilities is
the rollout's job (a forward pass); this is only the arithmetic.

Two readings (algorithms.md §9.3):
  value "prob" (paper Eq. 3) or "log_prob" (released A2TGPO code, IGPO's Feb-2026 train.sh);
  first_turn "question" (paper: every tool call gets an IG) or "skip" (released code: the first
  value only sets the baseline, so K tool calls give K−1 IGs and the first has none).
"""

from __future__ import annotations

from typing import Literal

import torch


def information_gain(
    *,
    gold_logprob_BK1: torch.Tensor,
    num_tool_calls_B: torch.Tensor,
    value: Literal["prob", "log_prob"] = "prob",
    first_turn: Literal["question", "skip"] = "question",
) -> tuple[torch.Tensor, torch.Tensor]:
    """IG of each tool-call turn and which turns have one.

    Args:
      gold_logprob_BK1: mean log-prob of the gold answer tokens; column 0 given the question
        only, column t (1..P_b) after tool-call turn t's observation; P_b = num_tool_calls_B[b].
        Non-finite values (a failed forward) make the IGs that use them absent, as IGPO skips a
        NaN/inf IG.
    Returns:
      ig_BK (B, K) with K = columns − 1: ig[b, t−1] = v_t − v_{t−1} for tool-call turn t;
      ig_mask_BK (B, K) bool: True where that IG exists (t <= P_b, finite, and t > 1 when
      first_turn == "skip").

    Shapes: gold_logprob_BK1 (B, K+1); num_tool_calls_B (B,).
    """
    if value not in ("prob", "log_prob") or first_turn not in ("question", "skip"):
        raise ValueError(f"value must be prob|log_prob and first_turn question|skip; got "
                         f"{value!r}, {first_turn!r}")
    v = gold_logprob_BK1.exp() if value == "prob" else gold_logprob_BK1
    ig = v[:, 1:] - v[:, :-1]  # (B, K)
    K = ig.shape[1]
    t = torch.arange(1, K + 1, device=ig.device)[None, :]  # tool-call turn number
    mask = (t <= num_tool_calls_B[:, None]) & torch.isfinite(ig)
    if first_turn == "skip":
        mask &= t > 1
    return torch.where(mask, ig, torch.zeros_like(ig)), mask
