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


def ig_by_turn(
    *,
    ig_BC: torch.Tensor,
    ig_mask_BC: torch.Tensor,
    tool_call_BK: torch.Tensor,
    num_turns_B: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move IG from tool-call index c to turn index k: the c-th tool call's IG goes to the turn
    that made that call.

    Turns and tool calls differ where a turn ends without a call but the episode goes on (an
    invalid action that is retried, a call-limit warning), so the k-th turn is not the k-th
    call. Only process turns (k < T_b − 1) keep an IG: the final turn's credit is the outcome
    alone (A2TGPO Eq. 9), whatever it ended with.

    Args:
      ig_BC, ig_mask_BC: IG of tool call c and whether it exists (`information_gain`'s output).
      tool_call_BK: turn k of trajectory b ended with a tool call.
      num_turns_B: T_b, turns per trajectory including the final one.
    Returns ig_BK (0 where absent) and ig_mask_BK, both (B, K).

    Shapes: ig_BC, ig_mask_BC (B, C); tool_call_BK (B, K); num_turns_B (B,).
    """
    B, K = tool_call_BK.shape
    calls = tool_call_BK.bool()
    call_index_BK = calls.long().cumsum(1) - 1  # index of the call made at turn k
    C = ig_BC.shape[1]
    if bool((calls & (call_index_BK >= C)).any()):
        raise ValueError(f"a trajectory makes more tool calls than the {C} IG columns given")
    process_BK = torch.arange(K, device=calls.device)[None, :] < (num_turns_B[:, None] - 1)
    if C == 0:
        return (torch.zeros(B, K, dtype=ig_BC.dtype, device=calls.device),
                torch.zeros(B, K, dtype=torch.bool, device=calls.device))
    idx = call_index_BK.clamp(0, C - 1)
    mask_BK = calls & process_BK & torch.gather(ig_mask_BC.bool(), 1, idx)
    ig_BK = torch.where(mask_BK, torch.gather(ig_BC, 1, idx), torch.zeros((), dtype=ig_BC.dtype))
    return ig_BK, mask_BK
