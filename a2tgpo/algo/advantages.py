"""Advantage estimators (pure torch): GRPO / Dr.GRPO, DAPO's pieces, the IGPO family (IGPO,
its additive ablations, A2TGPO) and GiGPO. Tree methods (Tree-GRPO, AT2PO) are in `tree.py`,
AEPO's entropy-aware scaling in `losses.py`.

Shape legend: B trajectories, K turns (max over the batch). Turn k of trajectory b exists for
k < num_turns_B[b]; turns 0..T_b−2 are tool-call ("process") turns, turn T_b−1 is the final
turn (the answer, or whatever ended the episode: truncation and call limits still get a final
turn, algorithms.md §13.11). Per-turn tensors carry _BK, per-trajectory ones _B.

Statistics conventions differ by method on purpose (algorithms.md §13.13): GRPO, DAPO and GiGPO
use the unbiased std (verl), and a group of one has mean 0 and std 1; the IGPO family uses the
population std, and a group of one normalises to 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from difflib import SequenceMatcher
from typing import Literal

import torch

from a2tgpo.algo.masks import turn_mask_from_counts

# --------------------------------------------------------------------------------------------
# grouping helpers


def group_index(group: torch.Tensor | Sequence[Hashable]) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels to 0..G−1 (first-appearance order); returns (index_B, G)."""
    if isinstance(group, torch.Tensor):
        _, inv = torch.unique(group, return_inverse=True)
        return inv, int(inv.max().item()) + 1 if inv.numel() else 0
    ids: dict[Hashable, int] = {}
    inv = torch.tensor([ids.setdefault(g, len(ids)) for g in group], dtype=torch.long)
    return inv, len(ids)


def segment_stats(x_N: torch.Tensor, seg_N: torch.Tensor, n_seg: int, *, unbiased: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, std and count of each segment, broadcast back to its members.

    Shapes: x_N (N,), seg_N (N,) in 0..n_seg−1 -> three (N,) tensors. With `unbiased`, a
    segment of one has std NaN (0/0); callers decide what a singleton means.
    """
    zeros = torch.zeros(n_seg, dtype=x_N.dtype, device=x_N.device)
    count = zeros.index_add(0, seg_N, torch.ones_like(x_N))
    mean = zeros.index_add(0, seg_N, x_N) / count.clamp(min=1)
    sq = zeros.index_add(0, seg_N, (x_N - mean[seg_N]) ** 2)
    std = torch.sqrt(sq / ((count - 1) if unbiased else count).clamp(min=1))
    if unbiased:
        std = torch.where(count > 1, std, torch.full_like(std, float("nan")))
    return mean[seg_N], std[seg_N], count[seg_N]


def _verl_group_z(x_N, seg_N, n_seg, *, norm_std: bool, eps: float) -> torch.Tensor:
    """verl's GRPO statistics: unbiased std; a group of one has mean 0, std 1."""
    mean, std, count = segment_stats(x_N, seg_N, n_seg, unbiased=True)
    single = count <= 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return (x_N - mean) / (std + eps) if norm_std else x_N - mean


def _population_z(x_N, seg_N, n_seg, *, eps: float) -> torch.Tensor:
    """IGPO/A2TGPO statistics: population std; a group of one normalises to exactly 0."""
    mean, std, count = segment_stats(x_N, seg_N, n_seg, unbiased=False)
    z = (x_N - mean) / (std + eps)
    return torch.where(count <= 1, torch.zeros_like(z), z)


# --------------------------------------------------------------------------------------------
# GRPO, Dr.GRPO, DAPO


def grpo_advantages(*, reward_B: torch.Tensor, group_B, norm_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO outcome advantage (arXiv 2402.03300; verl compute_grpo_outcome_advantage).

    A_b = (r_b − mean_g) / (std_g + eps) over the trajectories of b's group g, std unbiased;
    `norm_std=False` gives Dr.GRPO's mean-only A_b = r_b − mean_g (arXiv 2503.20783).
    A group of one has mean 0 and std 1 (verl), so A_b = r_b / (1 + eps).

    Shapes: reward_B (B,), group_B (B,) labels -> adv_B (B,).
    """
    inv, G = group_index(group_B)
    return _verl_group_z(reward_B, inv.to(reward_B.device), G, norm_std=norm_std, eps=eps)


def dynamic_sampling_keep(*, metric_B: torch.Tensor, group_B) -> torch.Tensor:
    """DAPO dynamic sampling (arXiv 2503.14476 §3.2; verl DAPO trainer): which trajectories to
    keep. A group whose metric (acc, score, seq_reward, ...) has zero spread carries no GRPO
    signal and is dropped whole; a group of one is kept (verl).

    Shapes: metric_B (B,), group_B (B,) -> keep_B (B,) bool.
    """
    inv, G = group_index(group_B)
    inv = inv.to(metric_B.device)
    x = metric_B.to(torch.float64)
    big = torch.full((G,), float("inf"), dtype=x.dtype, device=x.device)
    lo = big.scatter_reduce(0, inv, x, "amin")
    hi = (-big).scatter_reduce(0, inv, x, "amax")
    count = torch.zeros(G, dtype=x.dtype, device=x.device).index_add(0, inv, torch.ones_like(x))
    return ((hi > lo) | (count <= 1))[inv]


def overlong_penalty(*, length_B: torch.Tensor, max_length: int, buffer_length: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO overlong reward shaping (arXiv 2503.14476 Eq. 13; verl DAPORewardManager).

    0 up to max_length − buffer_length, then linearly down to −penalty_factor at max_length:
    R_len = min(−(ℓ − (L_max − L_buf)) / L_buf · factor, 0). Lengths here count what the
    caller counts; the released agentic code counts observation tokens too (§3 pitfall).

    Shapes: length_B (B,) -> penalty_B (B,) <= 0.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError("need 0 < buffer_length <= max_length")
    expected = max_length - buffer_length
    excess = length_B.to(torch.float64) - expected
    return torch.clamp(-excess / buffer_length * penalty_factor, max=0.0)


# --------------------------------------------------------------------------------------------
# IGPO family: IGPO, the additive ablation cells, A2TGPO

IgNorm = Literal["joint", "separate", "turn_group", "none"]


def igpo_family_advantages(
    *,
    ig_BK: torch.Tensor,
    ig_mask_BK: torch.Tensor,
    num_turns_B: torch.Tensor,
    outcome_B: torch.Tensor,
    group_B,
    ig_norm: IgNorm = "turn_group",
    outcome_mode: Literal["added", "discounted"] = "added",
    gamma: float = 1.0,
    sqrt_rescale: bool = True,
    process_weight: float = 1.0,
    beta: float = 0.3,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn-level advantages of IGPO (arXiv 2510.14967) and A2TGPO (arXiv 2605.06200 §4).

    One function with switches, so that the additive ablation cells are flags:
      IGPO            ig_norm="joint", outcome_mode="discounted", sqrt_rescale=False, beta=0
      + turn-group    ig_norm="turn_group"                                      (A2TGPO Eq. 6–7)
      + √n rescale    sqrt_rescale=True                                         (A2TGPO Eq. 8–9)
      + adaptive clip beta=0.3                                                  (A2TGPO Eq. 11)

    Normalisation of the IG values îg (population std, a pool of one gives 0):
      joint       one pool per prompt: all IG of all G rollouts and their outcomes (IGPO paper);
      separate    IG pooled per prompt over all turns; outcomes per prompt (IGPO code);
      turn_group  IG per (prompt, turn index) among rollouts that reach that turn (A2TGPO);
                  outcomes per prompt (R̂, population std: §9.3);
      none        raw IG; outcomes per prompt.
    Accumulation, for process turn t < T−1 of a trajectory with T turns:
      D_t = Σ_{k=t}^{T−2} γ^{k−t} îg_k (turns without IG add nothing), n_t = #IG terms in D_t;
      A_t = process_weight · D_t / (√n_t if sqrt_rescale else 1) + w_t · R̂,
      w_t = γ^{T−1−t} (outcome as the last discounted reward, IGPO) or 1 (added, A2TGPO);
      A_{T−1} = R̂ (the final turn gets the outcome only).
    Adaptive clip scale: c_t = 1 + β(2σ(îg_t) − 1) ∈ (1−β, 1+β) on process turns with IG, 1
    elsewhere; the PPO bounds become [1 − c·ε_low, 1 + c·ε_high].

    Args:
      ig_BK: IG of tool-call turn k (only entries with ig_mask_BK and k < T_b − 1 are read).
      ig_mask_BK: which process turns carry an IG (all of them in the paper's reading; the
        released code has none on the first tool call, and a NaN IG is dropped).
      num_turns_B: T_b, turns per trajectory including the final one (>= 1).
      outcome_B: outcome reward R_b; group_B: prompt labels.
    Returns: adv_BK, clip_BK (1 where no adaptive clip), ig_hat_BK (normalised IG, 0 where
      absent); all 0 (clip 1) at k >= T_b.

    Shapes: ig_BK, ig_mask_BK (B, K); num_turns_B, outcome_B (B,).
    """
    if outcome_mode not in ("added", "discounted"):
        raise ValueError(f"unknown outcome_mode {outcome_mode!r}")
    B, K = ig_BK.shape
    dev, dt = ig_BK.device, outcome_B.dtype
    inv, G = group_index(group_B)
    inv = inv.to(dev)
    turn_exists = turn_mask_from_counts(num_turns_B, K)  # (B, K)
    process = turn_exists & (torch.arange(K, device=dev)[None, :] < (num_turns_B[:, None] - 1))
    has_ig = process & ig_mask_BK.bool() & torch.isfinite(ig_BK)
    ig = torch.where(has_ig, ig_BK.to(dt), torch.zeros(B, K, dtype=dt, device=dev))

    # -- normalisation -------------------------------------------------------------------
    b_idx, k_idx = has_ig.nonzero(as_tuple=True)
    ig_vals = ig[b_idx, k_idx]
    ig_hat = torch.zeros(B, K, dtype=dt, device=dev)
    if ig_norm == "joint":
        # one pool per prompt holding the IG entries and the outcomes together
        vals = torch.cat([ig_vals, outcome_B])
        segs = torch.cat([inv[b_idx], inv])
        z = _population_z(vals, segs, G, eps=eps)
        ig_hat[b_idx, k_idx] = z[: len(ig_vals)]
        r_hat = z[len(ig_vals):]
    else:
        r_hat = _population_z(outcome_B, inv, G, eps=eps)
        if ig_norm == "separate":
            ig_hat[b_idx, k_idx] = _population_z(ig_vals, inv[b_idx], G, eps=eps)
        elif ig_norm == "turn_group":
            ig_hat[b_idx, k_idx] = _population_z(ig_vals, inv[b_idx] * K + k_idx, G * K, eps=eps)
        elif ig_norm == "none":
            ig_hat[b_idx, k_idx] = ig_vals
        else:
            raise ValueError(f"unknown ig_norm {ig_norm!r}")

    # -- discounted accumulation, backwards over turns ---------------------------------------
    D = torch.zeros(B, K, dtype=dt, device=dev)
    n = torch.zeros(B, K, dtype=dt, device=dev)
    carry_d = torch.zeros(B, dtype=dt, device=dev)
    carry_n = torch.zeros(B, dtype=dt, device=dev)
    for k in range(K - 1, -1, -1):
        carry_d = torch.where(process[:, k], ig_hat[:, k] + gamma * carry_d, carry_d)
        carry_n = torch.where(process[:, k], has_ig[:, k].to(dt) + carry_n, carry_n)
        D[:, k], n[:, k] = carry_d, carry_n
    scale = torch.sqrt(n.clamp(min=1)) if sqrt_rescale else torch.ones_like(n)
    steps_to_final = (num_turns_B[:, None] - 1 - torch.arange(K, device=dev)[None, :]).to(dt)
    w_out = gamma ** steps_to_final.clamp(min=0) if outcome_mode == "discounted" \
        else torch.ones_like(steps_to_final)
    process_term = torch.where(n > 0, process_weight * D / scale, torch.zeros_like(D))
    adv = torch.where(process, process_term + w_out * r_hat[:, None], r_hat[:, None].expand(B, K))
    adv = torch.where(turn_exists, adv, torch.zeros_like(adv))

    clip = 1 + beta * (2 * torch.sigmoid(ig_hat) - 1)
    clip = torch.where(has_ig, clip, torch.ones_like(clip))
    return adv, clip, ig_hat


# --------------------------------------------------------------------------------------------
# GiGPO


def anchor_clusters(anchors: Sequence[str], threshold: float | None) -> list[int]:
    """Cluster ids for anchor states (GiGPO Eq. 6; verl-agent build_step_group).

    threshold None: identical anchors share a cluster. Otherwise greedy: each anchor joins the
    first existing cluster whose representative (its first member) has
    difflib.SequenceMatcher ratio >= threshold, else starts a new one.
    """
    reps: list[str] = []
    exact: dict[str, int] = {}
    out = []
    for a in anchors:
        if threshold is None:
            out.append(exact.setdefault(a, len(exact)))
            continue
        for i, r in enumerate(reps):
            if SequenceMatcher(None, a, r).ratio() >= threshold:
                out.append(i)
                break
        else:
            reps.append(a)
            out.append(len(reps) - 1)
    return out


def gigpo_advantages(
    *,
    episode_reward_B: torch.Tensor,
    group_B,
    num_turns_B: torch.Tensor,
    anchors: Sequence[Sequence[str]],
    step_reward_BK: torch.Tensor | None = None,
    gamma: float = 0.95,
    omega: float = 1.0,
    mode: Literal["mean_norm", "mean_std_norm"] = "mean_std_norm",
    similarity_threshold: float | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """GiGPO (arXiv 2505.10978; verl-agent gigpo/core_gigpo.py): A = A^E + ω·A^S per step.

    A^E (Eq. 3): the episode reward normalised within its prompt group, pooled over step
      samples (each trajectory counts once per step, compute_mean_std_cross_steps=True);
    A^S (Eq. 5–7): the discounted step return R_t = Σ_{k≥t} γ^{k−t} r_k, normalised within its
      anchor-state cluster (steps of the same prompt group whose anchor observation is equal,
      or similar above the threshold); a cluster of one gives A^S = 0.
    Both use verl statistics (unbiased std, eps); mean_norm skips the division.

    Args:
      anchors: per trajectory, per step, the anchor observation (step 0: the question; later:
        the latest observation, as the search environment manager does).
      step_reward_BK: per-step rewards; default: the episode reward on the final step only.
    Returns adv_BK (B, K), 0 at k >= T_b.
    Shapes: episode_reward_B, num_turns_B (B,); step_reward_BK (B, K).
    """
    B = episode_reward_B.shape[0]
    K = int(num_turns_B.max().item())
    dev, dt = episode_reward_B.device, episode_reward_B.dtype
    exists = turn_mask_from_counts(num_turns_B, K)
    inv, G = group_index(group_B)
    inv = inv.to(dev)
    norm_std = mode == "mean_std_norm"

    b_idx, k_idx = exists.nonzero(as_tuple=True)  # one row per step sample
    a_e = _verl_group_z(episode_reward_B[b_idx], inv[b_idx], G, norm_std=norm_std, eps=eps)

    if step_reward_BK is None:
        last = (num_turns_B - 1).clamp(min=0)
        step_reward_BK = torch.zeros(B, K, dtype=dt, device=dev)
        step_reward_BK[torch.arange(B, device=dev), last] = episode_reward_B
    ret = torch.zeros(B, K, dtype=dt, device=dev)
    carry = torch.zeros(B, dtype=dt, device=dev)
    for k in range(K - 1, -1, -1):
        carry = torch.where(exists[:, k], step_reward_BK[:, k] + gamma * carry, carry)
        ret[:, k] = carry

    # anchor clusters, within each prompt group
    cluster = torch.empty(len(b_idx), dtype=torch.long)
    offset = 0
    for g in range(G):
        rows = (inv[b_idx] == g).nonzero(as_tuple=True)[0].tolist()
        ids = anchor_clusters([anchors[int(b_idx[r])][int(k_idx[r])] for r in rows],
                              similarity_threshold)
        for r, c in zip(rows, ids, strict=True):
            cluster[r] = offset + c
        offset += max(ids, default=-1) + 1
    cluster = cluster.to(dev)
    r_steps = ret[b_idx, k_idx]
    mean, std, count = segment_stats(r_steps, cluster, offset, unbiased=True)
    a_s = (r_steps - mean) / (std + eps) if norm_std else r_steps - mean
    a_s = torch.where(count <= 1, torch.zeros_like(a_s), a_s)

    adv = torch.zeros(B, K, dtype=dt, device=dev)
    adv[b_idx, k_idx] = a_e + omega * a_s
    return adv
