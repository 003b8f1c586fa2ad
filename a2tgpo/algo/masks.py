"""Masks, turn <-> token broadcasting and loss aggregation (pure torch).

Shape legend (house style): B trajectories, T tokens, K turns (max over the batch).
`turn_id_BT` is the explicit turn index of every token: k for tokens sampled in turn k, -1 for
prompt, observation and padding tokens. Turn-level tensors carry the suffix _BK, token-level _BT.

Aggregation (algorithms.md §1) takes its denominators as inputs, so a mini-batch split into
micro-batches and data-parallel ranks gives exactly the loss and gradients of the unsplit
mini-batch: pass the mini-batch's global token / sequence counts to every micro-batch, sum the
micro-batch losses (gradient accumulation) and average over ranks (as DDP/ZeRO do).
"""

from __future__ import annotations

import torch

from a2tgpo.algo.types import AGG_MODES, AggMode


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of `values` where `mask` is 1 (values at masked positions never matter, even NaN)."""
    v = torch.where(mask.bool(), values, torch.zeros_like(values))
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over mask == 1; 0 where the mask is empty (not NaN)."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return total / count.clamp(min=1)


def turn_mask_from_counts(num_turns_B: torch.Tensor, K: int) -> torch.Tensor:
    """(B, K) bool: turn k exists in trajectory b iff k < num_turns_B[b]."""
    return torch.arange(K, device=num_turns_B.device)[None, :] < num_turns_B[:, None]


def gather_turns(values_BK: torch.Tensor, turn_id_BT: torch.Tensor, fill: float = 0.0
                 ) -> torch.Tensor:
    """Broadcast per-turn values to tokens: out[b, t] = values_BK[b, turn_id_BT[b, t]].

    Shapes: values_BK (B, K); turn_id_BT (B, T) with -1 outside sampled turns.
    Returns (B, T), `fill` where turn_id_BT == -1.
    """
    idx = turn_id_BT.clamp(min=0).long()
    out = torch.gather(values_BK, 1, idx)
    return torch.where(turn_id_BT >= 0, out, torch.full_like(out, fill))


def turn_sum_count(values_BT: torch.Tensor, turn_id_BT: torch.Tensor, K: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn sum and token count of `values_BT` (tokens with turn_id -1 are ignored).

    Shapes: values_BT, turn_id_BT (B, T) -> sum_BK (B, K), count_BK (B, K).
    """
    B = values_BT.shape[0]
    valid = turn_id_BT >= 0
    # one extra bucket K collects the -1 tokens and is dropped
    idx = torch.where(valid, turn_id_BT, torch.full_like(turn_id_BT, K)).long()
    v = torch.where(valid, values_BT, torch.zeros_like(values_BT))
    s = torch.zeros(B, K + 1, dtype=values_BT.dtype, device=values_BT.device)
    c = torch.zeros(B, K + 1, dtype=values_BT.dtype, device=values_BT.device)
    s.scatter_add_(1, idx, v)
    c.scatter_add_(1, idx, valid.to(values_BT.dtype))
    return s[:, :K], c[:, :K]


def local_denominators(mask_BT: torch.Tensor) -> tuple[float, float]:
    """(tokens, sequences) of a batch: the denominators of its own aggregation.

    A sequence counts when it has at least one loss token (an all-masked row adds nothing).
    """
    return float(mask_BT.sum().item()), float((mask_BT.sum(-1) > 0).sum().item())


def aggregate_loss(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: AggMode, *,
                   global_tokens: float | None = None, global_seqs: float | None = None,
                   dp_size: int = 1, norm_length: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss to the scalar this (micro-)batch contributes (algorithms.md §1).

    Modes, with M the mask and ℓ the per-token loss, over the whole mini-batch:
      token-mean               Σ_{i,t} Mℓ / Σ_{i,t} M                (verl default, DAPO)
      seq-mean-token-mean      mean_i [Σ_t Mℓ / Σ_t M]               (GRPO, GSPO, ATPO,
                                                                      A2TGPO Eq. 12)
      seq-mean-token-sum       mean_i [Σ_t Mℓ]                       (IGPO)
      seq-mean-token-sum-norm  mean_i [Σ_t Mℓ] / norm_length         (Dr.GRPO; TRL's dr_grpo)

    Split invariance: with `global_tokens` / `global_seqs` the counts of the whole mini-batch
    across micro-batches and ranks, summing the returned values over micro-batches and averaging
    over `dp_size` ranks equals the unsplit loss (values and gradients). None = this batch's own
    counts (the unsplit case).

    Shapes: loss_BT, mask_BT (B, T). Returns a 0-dim tensor.
    """
    tokens, seqs = local_denominators(mask_BT)
    tokens = global_tokens if global_tokens is not None else tokens
    seqs = global_seqs if global_seqs is not None else seqs
    per_token = torch.where(mask_BT.bool(), loss_BT, torch.zeros_like(loss_BT))
    if mode == "token-mean":
        total = per_token.sum() / max(tokens, 1.0)
    elif mode == "seq-mean-token-mean":
        seq_tokens = mask_BT.to(loss_BT.dtype).sum(-1).clamp(min=1)
        total = (per_token.sum(-1) / seq_tokens).sum() / max(seqs, 1.0)
    elif mode == "seq-mean-token-sum":
        total = per_token.sum() / max(seqs, 1.0)
    elif mode == "seq-mean-token-sum-norm":
        if norm_length is None or norm_length <= 0:
            raise ValueError("seq-mean-token-sum-norm needs norm_length > 0 (e.g. the max "
                             "response length)")
        total = per_token.sum() / max(seqs, 1.0) / norm_length
    else:
        raise ValueError(f"unknown aggregation mode {mode!r}; valid: {', '.join(AGG_MODES)}")
    # ranks' losses are averaged by the gradient all-reduce; undo that for a global sum
    return total * dp_size
