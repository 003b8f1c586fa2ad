"""Policy losses (pure torch): importance ratios at token, sequence and turn level, the clipped
PPO objective with clip-higher, dual clip, adaptive per-token bounds and AEPO's
gradient-preserving upper clip, KL estimators, entropy, and AEPO's entropy-aware advantage.

Papers: PPO (arXiv 1707.06347), dual-clip PPO (1912.09729), DAPO clip-higher (2503.14476),
GSPO / GSPO-token (2507.18071 Eq. 5–7), AEPO (2510.14545), AT2PO turn ratio (2601.04767
Eq. 4–5), A2TGPO turn ratio and adaptive clip (2605.06200 Eq. 10–12). Reference code: verl
`verl/trainer/ppo/core_algos.py` (vanilla, gspo, kl_penalty, agg_loss), the AEPO copy in
`zzfoutofspace/ATPO: AEPO/verl_aepo_entropy/verl/trainer/ppo/core_algos.py`, and A2TGPO's
`compute_policy_loss_gspo_turn` (algorithms.md §0).

Shape legend: B trajectories, T tokens, K turns (max over the batch), V vocabulary. Token-level
tensors carry _BT, turn-level ones _BK. `turn_id_BT` is -1 outside sampled turns (masks.py).

Deviations from the reference code, on purpose:
- Turns for the turn ratio come from explicit turn ids, never from runs of equal advantage (the
  A2TGPO code merges adjacent turns whose advantages happen to be equal; algorithms.md §13.6).
- Reduction uses global token / sequence counts (current verl), so micro-batching and data
  parallelism do not change the loss; the ATPO / A2TGPO forks average per micro-batch.
- AEPO's entropy z-score is 0 when the entropies are all equal or there is at most one token;
  the AEPO code divides by a floating-point residue, or by NaN (unbiased std of one value).
"""

from __future__ import annotations

from typing import Literal

import torch

from a2tgpo.algo.masks import AggMode, aggregate_loss, gather_turns, masked_mean, turn_sum_count

RatioLevel = Literal["token", "sequence", "turn"]
UpperClip = Literal["hard", "gradient_preserving"]
KLKind = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]

RATIO_LEVELS: tuple[str, ...] = ("token", "sequence", "turn")
UPPER_CLIPS: tuple[str, ...] = ("hard", "gradient_preserving")
KL_KINDS: tuple[str, ...] = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")

# verl clamps the token log-ratio to ±20 (compute_policy_loss_vanilla) and the GSPO-style
# composed log-ratio at 10 from above only (compute_policy_loss_gspo): exp() stays finite.
TOKEN_LOG_RATIO_CLAMP = 20.0
SEQ_LOG_RATIO_MAX = 10.0


# --------------------------------------------------------------------------------------------
# importance ratios (log space)


def token_log_ratio(*, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token log importance ratio log π_θ − log π_old, clamped to [−20, 20] (verl vanilla).

    PPO (arXiv 1707.06347 Eq. 6): r_t = π_θ(y_t) / π_old(y_t).

    Shapes: logp_BT, old_logp_BT (B, T) -> (B, T).
    """
    return (logp_BT - old_logp_BT).clamp(-TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)


def _stop_grad_shift(logp_BT: torch.Tensor, log_ratio_BT: torch.Tensor) -> torch.Tensor:
    """log π − sg(log π) + sg(log_ratio), clamped at 10: the value is `log_ratio` on every token,
    the gradient is ∇log π per token (GSPO-token, arXiv 2507.18071 Eq. 7)."""
    shifted = logp_BT - logp_BT.detach() + log_ratio_BT.detach()
    return shifted.clamp(max=SEQ_LOG_RATIO_MAX)


def sequence_log_ratio(*, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor,
                       mask_BT: torch.Tensor) -> torch.Tensor:
    """GSPO-token log-ratio: log s_i on every token, with per-token gradient.

    GSPO (arXiv 2507.18071 Eq. 5, 7): log s_i = (1/|y_i|) Σ_t M_t (log π_θ − log π_old), the
    length-normalised sequence ratio over the loss tokens only. The token form is
    log π − sg(log π) + sg(log s_i), clamped at max 10 (verl), so exp() of it equals s_i on
    every token while its gradient is s_i·∇log π(y_{i,t}).

    Shapes: logp_BT, old_logp_BT, mask_BT (B, T) -> (B, T).
    """
    seq_mean_B = masked_mean(logp_BT - old_logp_BT, mask_BT, dim=-1)  # (B,)
    return _stop_grad_shift(logp_BT, seq_mean_B[:, None].expand_as(logp_BT))


def turn_log_ratio(*, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor,
                   turn_id_BT: torch.Tensor, mask_BT: torch.Tensor, K: int) -> torch.Tensor:
    """Turn-level log-ratio in GSPO-token form (AT2PO Eq. 4–5; A2TGPO Eq. 10).

    log s_{i,k} = mean over the loss tokens of turn k of (log π_θ − log π_old); each token of
    turn k gets log π − sg(log π) + sg(log s_{i,k}), clamped at max 10. Only tokens with
    turn_id ≥ 0 and mask 1 enter a turn's mean, so observation and padding tokens never do.
    Tokens outside every turn get log π − sg(log π) (value 0).

    Shapes: logp_BT, old_logp_BT, turn_id_BT, mask_BT (B, T); K the number of turn slots
    (> max turn id) -> (B, T).
    """
    turn_id_BT = _loss_turn_ids(turn_id_BT, mask_BT)
    s_BK, c_BK = turn_sum_count(logp_BT - old_logp_BT, turn_id_BT, K)
    turn_mean_BK = s_BK / c_BK.clamp(min=1)  # (B, K)
    return _stop_grad_shift(logp_BT, gather_turns(turn_mean_BK, turn_id_BT))


def _loss_turn_ids(turn_id_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Turn ids restricted to loss tokens (-1 where mask is 0)."""
    return torch.where(mask_BT.bool(), turn_id_BT, torch.full_like(turn_id_BT, -1))


# --------------------------------------------------------------------------------------------
# clipped policy loss


def policy_loss(*, logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor,
                mask_BT: torch.Tensor, ratio_level: RatioLevel, clip_low: float,
                clip_high: float, agg_mode: AggMode,
                clip_scale_BT: torch.Tensor | None = None, dual_clip: float | None = None,
                upper_clip: UpperClip = "hard", turn_id_BT: torch.Tensor | None = None,
                K: int | None = None, global_tokens: float | None = None,
                global_seqs: float | None = None, dp_size: int = 1,
                norm_length: float | None = None) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate loss for every method: PPO / GRPO / DAPO / GSPO / AEPO / AT2PO / A2TGPO.

    Per token, with ratio r (token, GSPO-token sequence, or turn level), advantage A and bounds
    lo = 1 − c·ε_low, hi = 1 + c·ε_high (c = `clip_scale_BT`, 1 when None; A2TGPO Eq. 11):
        ℓ = max(−A·r, −A·clip(r, lo, hi))                        (PPO Eq. 7; DAPO Eq. 10)
        ℓ = min(ℓ, −A·dual_clip)   where A < 0, if dual_clip      (dual-clip PPO, verl c = 3)
    `upper_clip="gradient_preserving"` (AEPO / GPPO) replaces hi by hi·r/sg(r): the same value,
    but the clipped upper side keeps the gradient hi·∇log π instead of 0. The low side stays a
    hard clip. The per-token loss is reduced by `masks.aggregate_loss`; pass the mini-batch's
    global counts and `dp_size` for split-invariant micro-batches.

    Values at mask == 0 positions never matter (they may be NaN); those positions get zero
    gradient.

    Args:
        ratio_level: "token" (verl vanilla), "sequence" (GSPO-token), "turn" (AT2PO / A2TGPO,
            needs `turn_id_BT`).
        clip_low, clip_high: ε_low, ε_high.
        agg_mode, global_tokens, global_seqs, dp_size, norm_length: see `masks.aggregate_loss`.
        clip_scale_BT: adaptive clip scale c (stop-gradient), e.g. A2TGPO's 1 + β(2σ(îg) − 1).
        dual_clip: c of dual-clip PPO (> 1), or None for none (GSPO, AT2PO, A2TGPO).
        upper_clip: "hard" or "gradient_preserving".
        turn_id_BT: turn ids (-1 outside turns); required for "turn", and when given, clip
            fractions are also reported per turn.
        K: number of turn slots; None = max turn id + 1.

    Returns:
        (loss, diagnostics). The loss is a 0-dim tensor. Diagnostics are detached, computed
        over this batch's mask == 1 tokens (not global counts):
          pg_clipfrac       verl `pg_clipfrac`: fraction where the clipped term is the max, i.e.
                            −A·clip(r) > −A·r ⇔ (A > 0 and r > hi) or (A < 0 and r < lo);
          pg_clipfrac_high  the A > 0, r > hi part;  pg_clipfrac_low  the A < 0, r < lo part
                            (they sum to pg_clipfrac);
          pg_clipfrac_dual  verl's (misnamed) `pg_clipfrac_lower`: A < 0 and the PPO loss
                            exceeds −A·dual_clip, i.e. the dual clip is active; 0 without it;
          ppo_kl            verl `ppo_kl`: mean of −(log π − log π_old) per token, clamped
                            to ±20 at token level (verl vanilla), unclamped at sequence and
                            turn level (verl GSPO);
          ratio_mean, ratio_min, ratio_max   of the ratio in the objective (NaN if no token);
          pg_clipfrac_by_turn   {turn k: pg_clipfrac over turn k's tokens}, turns present only
                            (only when turn_id_BT is given).

    Shapes: logp_BT, old_logp_BT, adv_BT, mask_BT, clip_scale_BT, turn_id_BT (B, T).
    """
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"unknown ratio_level {ratio_level!r}; valid: {', '.join(RATIO_LEVELS)}")
    if upper_clip not in UPPER_CLIPS:
        raise ValueError(f"unknown upper_clip {upper_clip!r}; valid: {', '.join(UPPER_CLIPS)}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl clip_ratio_c), got {dual_clip}")
    if ratio_level == "turn" and turn_id_BT is None:
        raise ValueError("ratio_level='turn' needs turn_id_BT")

    # a where() on log π cuts every gradient path into masked positions, so whatever they hold
    # (NaN advantages included) cannot leak into the gradients; their values are dropped by the
    # masked reductions below
    valid = mask_BT.bool()
    logp_BT = torch.where(valid, logp_BT, torch.zeros_like(logp_BT))

    tok_log_ratio_BT = token_log_ratio(logp_BT=logp_BT, old_logp_BT=old_logp_BT)
    if turn_id_BT is not None:
        if K is None:
            K = int(turn_id_BT.max().item()) + 1 if turn_id_BT.numel() else 1
        K = max(K, 1)
    if ratio_level == "token":
        log_ratio_BT = tok_log_ratio_BT
    elif ratio_level == "sequence":
        log_ratio_BT = sequence_log_ratio(logp_BT=logp_BT, old_logp_BT=old_logp_BT,
                                          mask_BT=mask_BT)
    else:
        if bool((valid & (turn_id_BT < 0)).any()):
            raise ValueError("every loss token (mask == 1) must belong to a turn (turn_id >= 0)")
        log_ratio_BT = turn_log_ratio(logp_BT=logp_BT, old_logp_BT=old_logp_BT,
                                      turn_id_BT=turn_id_BT, mask_BT=mask_BT, K=K)
    ratio_BT = torch.exp(log_ratio_BT)

    scale_BT = torch.ones_like(logp_BT) if clip_scale_BT is None else clip_scale_BT.detach()
    lower_BT = 1.0 - scale_BT * clip_low
    upper_BT = 1.0 + scale_BT * clip_high
    if upper_clip == "gradient_preserving":
        # value hi, gradient hi·∇log π (AEPO: (1+ε_high)·r/sg(r))
        upper_BT = upper_BT * ratio_BT / ratio_BT.detach()
    clipped_BT = torch.maximum(torch.minimum(ratio_BT, upper_BT), lower_BT)

    loss1_BT = -adv_BT * ratio_BT
    loss2_BT = -adv_BT * clipped_BT
    ppo_BT = torch.maximum(loss1_BT, loss2_BT)
    loss_BT = ppo_BT
    if dual_clip is not None:
        loss_BT = torch.where(adv_BT < 0, torch.minimum(ppo_BT, -adv_BT * dual_clip), ppo_BT)

    loss = aggregate_loss(loss_BT, mask_BT, agg_mode, global_tokens=global_tokens,
                          global_seqs=global_seqs, dp_size=dp_size, norm_length=norm_length)

    with torch.no_grad():
        clip_active = loss2_BT > loss1_BT
        high = clip_active & (adv_BT > 0)
        low = clip_active & (adv_BT < 0)
        dual = ((adv_BT < 0) & (ppo_BT > -adv_BT * dual_clip) if dual_clip is not None
                else torch.zeros_like(valid))
        r_valid = ratio_BT.detach()[valid]
        nan = torch.tensor(float("nan"), dtype=ratio_BT.dtype, device=ratio_BT.device)
        diagnostics = {
            "pg_clipfrac": masked_mean(clip_active.to(logp_BT.dtype), mask_BT),
            "pg_clipfrac_high": masked_mean(high.to(logp_BT.dtype), mask_BT),
            "pg_clipfrac_low": masked_mean(low.to(logp_BT.dtype), mask_BT),
            "pg_clipfrac_dual": masked_mean(dual.to(logp_BT.dtype), mask_BT),
            # verl: the clamped log-ratio at token level (compute_policy_loss_vanilla), the
            # unclamped one under a composed ratio (compute_policy_loss_gspo)
            "ppo_kl": masked_mean(-(tok_log_ratio_BT if ratio_level == "token"
                                    else logp_BT - old_logp_BT).detach(), mask_BT),
            "ratio_mean": r_valid.mean() if r_valid.numel() else nan,
            "ratio_min": r_valid.min() if r_valid.numel() else nan,
            "ratio_max": r_valid.max() if r_valid.numel() else nan,
        }
        if turn_id_BT is not None:
            s_BK, c_BK = turn_sum_count(clip_active.to(logp_BT.dtype),
                                        _loss_turn_ids(turn_id_BT, mask_BT), K)
            s_K, c_K = s_BK.sum(0), c_BK.sum(0)
            diagnostics["pg_clipfrac_by_turn"] = {
                k: s_K[k] / c_K[k] for k, n in enumerate(c_K.tolist()) if n > 0}
    return loss, diagnostics


# --------------------------------------------------------------------------------------------
# KL to the reference policy


def kl_penalty(*, logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: KLKind
               ) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate, as verl `core_algos.kl_penalty`.

    Schulman, "Approximating KL divergence" (2020), with d = log π_θ − log π_ref:
      k1 / kl      d
      abs          |d|
      k2 / mse     d²/2
      k3 / low_var_kl   exp(−d) + d − 1, with −d clamped to [−20, 20] before exp and the
                   result clamped to [−10, 10] (verl); ≥ 0, the GRPO paper's estimator (Eq. 4).

    Shapes: logp_BT, ref_logp_BT (B, T) -> (B, T).
    """
    d = logp_BT - ref_logp_BT
    if kind in ("k1", "kl"):
        return d
    if kind == "abs":
        return d.abs()
    if kind in ("k2", "mse"):
        return 0.5 * d.square()
    if kind in ("k3", "low_var_kl"):
        neg_d = (-d).clamp(-20.0, 20.0)
        return (torch.exp(neg_d) - neg_d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; valid: {', '.join(KL_KINDS)}")


# --------------------------------------------------------------------------------------------
# AEPO entropy-aware advantage


def entropy_aware_advantage(*, adv_BT: torch.Tensor, entropy_BT: torch.Tensor,
                            mask_BT: torch.Tensor, alpha: float = 0.2) -> torch.Tensor:
    """AEPO entropy-aware advantage Ã = A·(1 + α·z(H)) (arXiv 2510.14545; algorithms.md §7.2).

    z is the z-score of the token entropies over the mask == 1 tokens of the batch passed in,
    detached. Like the AEPO code (`compute_policy_loss_entropy_balanced_clipping`, α = 0.2) it
    uses the unbiased std and runs per micro-batch, so it is not split invariant: pass the
    whole mini-batch to make it so. z = 0 when the masked entropies are all equal or there is
    at most one (the AEPO code divides by a float residue or NaN there). Ã = A where mask == 0.

    Shapes: adv_BT, entropy_BT, mask_BT (B, T) -> (B, T).
    """
    valid = mask_BT.bool()
    h = torch.where(valid, entropy_BT.detach(), torch.zeros_like(adv_BT))
    n = valid.sum()
    mean = h.sum() / n.clamp(min=1)
    centred = torch.where(valid, h - mean, torch.zeros_like(h))
    std = torch.sqrt(centred.square().sum() / (n - 1).clamp(min=1))
    spread = (torch.where(valid, h, torch.full_like(h, -torch.inf)).amax()
              - torch.where(valid, h, torch.full_like(h, torch.inf)).amin())
    # exact test for constant entropy: the mean of equal floats need not equal them
    z = torch.where(valid & (spread > 0), centred / std.clamp(min=torch.finfo(h.dtype).tiny),
                    torch.zeros_like(h))
    return adv_BT * (1.0 + alpha * z)
