"""Tests for a2tgpo.algo.losses: hand-derived values in float64, gradients checked with autograd,
the reductions the papers state, mask properties, and micro-batch / rank split invariance."""

import math

import pytest
import torch

from a2tgpo.algo import losses as L
from a2tgpo.algo.logprobs import entropy_from_logprobs
from a2tgpo.algo.masks import AGG_MODES, local_denominators

D = torch.float64


def close(actual, expected):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=D), torch.as_tensor(expected, dtype=D),
                               atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# hand batch for the PPO loss: B=2, T=4, ratios chosen directly, old log-prob -1 everywhere
#
#   r    = [[1.5, 0.5, 1.1, 0.9], [4.0, 0.7, 1.0, 1.3]]
#   A    = [[ +1,  -1,  -1,  +2], [ -1,  +1,  -2,  -1]]
#   mask = [[  1,   1,   1,   0], [  1,   1,   1,   1]]
#
# ε_low 0.2, ε_high 0.28 -> bounds [0.8, 1.28]; per token ℓ = max(−A·r, −A·clip(r)):
#   (0,0) A>0, r 1.5 > 1.28: max(−1.5, −1.28) = −1.28   clipped (high side), gradient 0
#   (0,1) A<0, r 0.5 < 0.8 : max( 0.5,  0.8 ) =  0.8    clipped (low side),  gradient 0
#   (0,2)                    max( 1.1,  1.1 ) =  1.1
#   (1,0) A<0, r 4         : max( 4  ,  1.28) =  4      (dual clip c=3 -> min(4, 3) = 3)
#   (1,1) A>0, r 0.7 < 0.8 : max(−0.7, −0.8 ) = −0.7   not clipped (the low side binds only A<0)
#   (1,2)                    2;  (1,3) A<0, r 1.3 > 1.28: max(1.3, 1.28) = 1.3, not clipped
# token-mean over 7 tokens: (−1.28 + 0.8 + 1.1 + 4 − 0.7 + 2 + 1.3)/7 = 7.22/7
R = [[1.5, 0.5, 1.1, 0.9], [4.0, 0.7, 1.0, 1.3]]
A = [[1.0, -1.0, -1.0, 2.0], [-1.0, 1.0, -2.0, -1.0]]
M = [[1, 1, 1, 0], [1, 1, 1, 1]]


def hand_batch():
    old = torch.full((2, 4), -1.0, dtype=D)
    logp = (old + torch.log(torch.tensor(R, dtype=D))).requires_grad_(True)
    return dict(logp_BT=logp, old_logp_BT=old, adv_BT=torch.tensor(A, dtype=D),
                mask_BT=torch.tensor(M, dtype=D))


def run_hand(**kw):
    batch = hand_batch()
    loss, diag = L.policy_loss(**batch, ratio_level=kw.pop("ratio_level", "token"),
                               clip_low=0.2, clip_high=0.28,
                               agg_mode=kw.pop("agg_mode", "token-mean"), **kw)
    loss.backward()
    return loss, diag, batch["logp_BT"].grad


def test_token_log_ratio_clamps_at_20():
    logp = torch.tensor([[-1.0, -30.0, 0.0]], dtype=D)
    old = torch.tensor([[-1.5, 0.0, -30.0]], dtype=D)
    # differences 0.5, −30, 30 -> 0.5, −20, 20
    close(L.token_log_ratio(logp_BT=logp, old_logp_BT=old), [[0.5, -20.0, 20.0]])


def test_ppo_token_level_hand_values_and_gradients():
    loss, diag, grad = run_hand()
    close(loss, 7.22 / 7)
    # d loss / d log π_t = −A·r/7 where unclipped (d r / d log π = r), 0 where clipped or masked;
    # (1,0) without dual clip: −(−1)·4/7
    close(grad, [[0.0, 0.0, 1.1 / 7, 0.0], [4.0 / 7, -0.7 / 7, 2.0 / 7, 1.3 / 7]])
    close(diag["pg_clipfrac"], 2 / 7)
    close(diag["pg_clipfrac_high"], 1 / 7)  # (0,0)
    close(diag["pg_clipfrac_low"], 1 / 7)  # (0,1)
    close(diag["pg_clipfrac_dual"], 0.0)
    # ppo_kl = mean of −log r over the 7 loss tokens; ratio stats over the same tokens
    logs = [math.log(r) for r in (1.5, 0.5, 1.1, 4.0, 0.7, 1.0, 1.3)]
    close(diag["ppo_kl"], -sum(logs) / 7)
    close(diag["ratio_mean"], 10.1 / 7)
    close(diag["ratio_min"], 0.5)
    close(diag["ratio_max"], 4.0)


def test_ppo_seq_mean_token_mean_hand_value():
    loss, _, _ = run_hand(agg_mode="seq-mean-token-mean")
    # row 0: (−1.28 + 0.8 + 1.1)/3 = 0.62/3; row 1: (4 − 0.7 + 2 + 1.3)/4 = 6.6/4
    close(loss, (0.62 / 3 + 6.6 / 4) / 2)


def test_dual_clip_caps_negative_advantage_only():
    loss, diag, grad = run_hand(dual_clip=3.0)
    # (1,0): min(4, −A·3 = 3) = 3, a constant -> gradient 0; nothing else changes
    close(loss, 6.22 / 7)
    close(grad, [[0.0, 0.0, 1.1 / 7, 0.0], [0.0, -0.7 / 7, 2.0 / 7, 1.3 / 7]])
    close(diag["pg_clipfrac_dual"], 1 / 7)
    # a positive advantage with a huge ratio is never dual-clipped: A=+1, r=4 -> ℓ = −1.28
    old = torch.zeros(1, 1, dtype=D)
    loss_pos, diag_pos = L.policy_loss(
        logp_BT=torch.log(torch.tensor([[4.0]], dtype=D)), old_logp_BT=old,
        adv_BT=torch.ones(1, 1, dtype=D), mask_BT=torch.ones(1, 1), ratio_level="token",
        clip_low=0.2, clip_high=0.28, agg_mode="token-mean", dual_clip=3.0)
    close(loss_pos, -1.28)
    close(diag_pos["pg_clipfrac_dual"], 0.0)
    with pytest.raises(ValueError, match="dual_clip"):
        run_hand(dual_clip=1.0)


def test_gradient_preserving_clip_same_value_gradient_flows():
    hard_loss, _, hard_grad = run_hand(dual_clip=3.0)
    gp_loss, gp_diag, gp_grad = run_hand(dual_clip=3.0, upper_clip="gradient_preserving")
    close(gp_loss, hard_loss)
    # (0,0): ℓ = −A·1.28·r/sg(r) -> d ℓ / d log π = −A·1.28 = −1.28, /7; the hard clip gives 0.
    # The low side (0,1) stays a hard clip: 0 in both.
    assert hard_grad[0, 0] == 0.0
    expected = hard_grad.clone()
    expected[0, 0] = -1.28 / 7
    close(gp_grad, expected)
    close(gp_diag["pg_clipfrac_high"], 1 / 7)


def test_adaptive_clip_bounds_use_scale():
    scale = torch.ones(2, 4, dtype=D)
    scale[0, 0] = 2.0  # hi = 1 + 2·0.28 = 1.56 > r = 1.5 -> unclipped, ℓ = −1.5
    scale[0, 1] = 0.5  # lo = 1 − 0.5·0.2 = 0.9 -> ℓ = max(0.5, 0.9) = 0.9
    scale[0, 3] = 100.0  # masked position: ignored
    scale.requires_grad_(True)
    loss, diag, grad = run_hand(clip_scale_BT=scale)
    close(loss, (-1.5 + 0.9 + 1.1 + 4 - 0.7 + 2 + 1.3) / 7)
    close(grad[0, 0], 1.5 / 7 * -1)  # −A·r/7 with A = +1
    close(diag["pg_clipfrac_high"], 0.0)
    close(diag["pg_clipfrac_low"], 1 / 7)
    assert scale.grad is None  # c is a stop-gradient (A2TGPO Eq. 11)


def test_policy_loss_rejects_bad_options():
    with pytest.raises(ValueError, match="ratio_level"):
        run_hand(ratio_level="segment")
    with pytest.raises(ValueError, match="upper_clip"):
        run_hand(upper_clip="soft")
    with pytest.raises(ValueError, match="turn_id_BT"):
        run_hand(ratio_level="turn")
    # a loss token outside every turn is an upstream bug, not something to average over
    with pytest.raises(ValueError, match="belong to a turn"):
        run_hand(ratio_level="turn", turn_id_BT=torch.tensor([[0, 0, -1, -1], [0, 0, 1, 1]]))


# --------------------------------------------------------------------------------------------
# GSPO and GSPO-token


def test_sequence_log_ratio_value_and_gradient():
    # log-ratios: row 0 [0.1, 0.2, 0.3, (masked 9)] -> mean 0.2; row 1 [−0.4, 0, (masked)...]
    # -> mean −0.2. The GSPO-token value is that mean on every token, masked ones included.
    old = torch.tensor([[-1.0, -2.0, -1.5, -1.0], [-0.5, -1.0, -2.0, -3.0]], dtype=D)
    lr = torch.tensor([[0.1, 0.2, 0.3, 9.0], [-0.4, 0.0, 5.0, 5.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=D)
    logp = (old + lr).requires_grad_(True)
    out = L.sequence_log_ratio(logp_BT=logp, old_logp_BT=old, mask_BT=mask)
    close(out, [[0.2] * 4, [-0.2] * 4])
    # gradient of Σ_t w_t·exp(out_t) is s_i·w_t: each token's own ∇log π scaled by s_i
    w = torch.tensor([[1.0, -2.0, 0.5, 3.0], [2.0, 1.0, 0.0, -1.0]], dtype=D)
    (torch.exp(out) * w).sum().backward()
    s = torch.tensor([[math.exp(0.2)], [math.exp(-0.2)]], dtype=D)
    close(logp.grad, s * w)
    # clamp at max 10: a mean log-ratio of 12 reads 10
    big = L.sequence_log_ratio(logp_BT=old + 12.0, old_logp_BT=old, mask_BT=mask)
    close(big, torch.full((2, 4), 10.0, dtype=D))


def random_batch(seed, B=6, T=10):
    """Rows of [turn tokens (mask 1, turn k)] [observation (mask 0, turn −1)] ..., with one row
    fully masked on even seeds, so empty sequences are exercised."""
    g = torch.Generator().manual_seed(seed)
    turn_id = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        pos, k = 0, 0
        while pos < T:
            n = int(torch.randint(1, 4, (1,), generator=g))
            turn_id[b, pos:pos + n] = k
            pos += n + int(torch.randint(0, 3, (1,), generator=g))
            k += 1
    if seed % 2 == 0:
        turn_id[B - 2] = -1
    mask = (turn_id >= 0).to(D)
    logp = -2.0 * torch.rand(B, T, generator=g, dtype=D)
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=D)
    adv = torch.randn(B, T, generator=g, dtype=D)
    scale = 0.7 + 0.6 * torch.rand(B, T, generator=g, dtype=D)
    return dict(logp_BT=logp, old_logp_BT=old, adv_BT=adv, mask_BT=mask), turn_id, scale


def loss_and_grad(batch, **kw):
    logp = batch["logp_BT"].detach().clone().requires_grad_(True)
    loss, diag = L.policy_loss(**{**batch, "logp_BT": logp}, **kw)
    loss.backward()
    return loss.detach(), logp.grad, diag


def test_gspo_token_equals_gspo_with_sequence_advantages():
    batch, _, _ = random_batch(1)
    adv_B = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.3], dtype=D)
    batch["adv_BT"] = adv_B[:, None].expand(-1, 10).clone()
    eps_low, eps_high = 0.03, 0.04
    loss, grad, diag = loss_and_grad(batch, ratio_level="sequence", clip_low=eps_low,
                                     clip_high=eps_high, agg_mode="seq-mean-token-mean")
    assert 0 < diag["pg_clipfrac"] < 1  # both clipped and unclipped sequences occur
    # GSPO (Eq. 5–6) with the real sequence ratio s_i = exp(mean_t log r) and full autograd
    logp = batch["logp_BT"].detach().clone().requires_grad_(True)
    mask = batch["mask_BT"]
    n = mask.sum(-1)
    s = torch.exp(((logp - batch["old_logp_BT"]) * mask).sum(-1) / n.clamp(min=1))
    per_seq = torch.maximum(-adv_B * s, -adv_B * s.clamp(1 - eps_low, 1 + eps_high))
    ref = per_seq[n > 0].mean()
    ref.backward()
    close(loss, ref)
    close(grad, logp.grad)


# --------------------------------------------------------------------------------------------
# turn-level ratio (AT2PO / A2TGPO)


def test_turn_log_ratio_hand_values():
    # turn ids [0, 0, −1, 1, 1, −1]; log-ratios [0.1, 0.3, 5, −0.2, 0, 7] (obs tokens 5 and 7)
    # turn means: 0.2 and −0.1; observation tokens take no part.
    turn_id = torch.tensor([[0, 0, -1, 1, 1, -1]])
    mask = (turn_id >= 0).to(D)
    old = torch.tensor([[-1.0, -2.0, -3.0, -1.0, -0.5, -2.0]], dtype=D)
    logp = old + torch.tensor([[0.1, 0.3, 5.0, -0.2, 0.0, 7.0]], dtype=D)
    out = L.turn_log_ratio(logp_BT=logp, old_logp_BT=old, turn_id_BT=turn_id, mask_BT=mask, K=2)
    close(out[mask.bool()], [0.2, 0.2, -0.1, -0.1])
    # a turn whose mean log-ratio is 12 reads 10 (clamp max=10, as GSPO)
    out = L.turn_log_ratio(logp_BT=old + 12.0, old_logp_BT=old, turn_id_BT=turn_id,
                           mask_BT=mask, K=2)
    close(out[mask.bool()], [10.0] * 4)


def test_adjacent_turns_with_equal_advantage_keep_their_own_ratio():
    # two turns back to back (no observation between) and the same advantage: the A2TGPO code
    # would merge them into one run; explicit turn ids keep exp(0.2) and exp(−0.1) apart
    turn_id = torch.tensor([[0, 0, 1, 1]])
    mask = torch.ones(1, 4, dtype=D)
    old = torch.zeros(1, 4, dtype=D)
    logp = torch.tensor([[0.1, 0.3, -0.2, 0.0]], dtype=D)
    _, diag = L.policy_loss(logp_BT=logp, old_logp_BT=old, adv_BT=torch.ones(1, 4, dtype=D),
                            mask_BT=mask, ratio_level="turn", turn_id_BT=turn_id, K=2,
                            clip_low=0.2, clip_high=0.2, agg_mode="token-mean")
    close(diag["ratio_min"], math.exp(-0.1))
    close(diag["ratio_max"], math.exp(0.2))


def test_turn_ratio_ignores_masked_tokens_inside_a_turn():
    # a token with a turn id but mask 0 (e.g. cut by truncation) is not part of the turn's mean
    turn_id = torch.tensor([[0, 0, 0, 1]])
    mask = torch.tensor([[1, 1, 0, 1]], dtype=D)
    old = torch.zeros(1, 4, dtype=D)
    a = L.turn_log_ratio(logp_BT=torch.tensor([[0.1, 0.3, 9.0, 0.5]], dtype=D), old_logp_BT=old,
                         turn_id_BT=turn_id, mask_BT=mask, K=2)
    b = L.turn_log_ratio(logp_BT=torch.tensor([[0.1, 0.3, -4.0, 0.5]], dtype=D),
                         old_logp_BT=old, turn_id_BT=turn_id, mask_BT=mask, K=2)
    close(a[mask.bool()], [0.2, 0.2, 0.5])
    close(b[mask.bool()], a[mask.bool()])


@pytest.mark.parametrize("ratio_level", L.RATIO_LEVELS)
def test_masked_positions_never_matter(ratio_level):
    # property: logp, old logp, advantage and clip scale at mask == 0 positions (observations,
    # padding; turn −1) may be anything, even NaN: same loss, same gradients (0 there)
    for seed in range(4):
        batch, turn_id, scale = random_batch(seed)
        kw = dict(ratio_level=ratio_level, clip_low=0.1, clip_high=0.15, dual_clip=3.0,
                  agg_mode="seq-mean-token-mean", turn_id_BT=turn_id, clip_scale_BT=scale)
        loss, grad, diag = loss_and_grad(batch, **kw)
        off = batch["mask_BT"] == 0
        assert (grad[off] == 0).all()
        g = torch.Generator().manual_seed(100 + seed)
        noisy = {k: torch.where(off, 30 * torch.randn(v.shape, generator=g, dtype=D), v)
                 for k, v in batch.items() if k != "mask_BT"}
        # one NaN input at a time: a NaN log-ratio would hide a NaN advantage's gradient
        # behind the clamp's backward
        for nan_keys in (["logp_BT"], ["old_logp_BT"], ["adv_BT"]):
            bad = {k: torch.where(off, torch.nan, v) if k in nan_keys else v
                   for k, v in noisy.items()}
            noisy_scale = torch.where(off, torch.nan, scale)
            loss2, grad2, diag2 = loss_and_grad({**bad, "mask_BT": batch["mask_BT"]},
                                                **{**kw, "clip_scale_BT": noisy_scale})
            close(loss2, loss)
            close(grad2, grad)
            for key in ("pg_clipfrac", "ppo_kl", "ratio_mean", "ratio_max"):
                close(diag2[key], diag[key])


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_turn_level_reduces_to_sequence_and_token_level(agg_mode):
    for seed in range(3):
        batch, _, scale = random_batch(seed)
        kw = dict(clip_low=0.05, clip_high=0.08, agg_mode=agg_mode, clip_scale_BT=scale)
        mask = batch["mask_BT"].bool()
        # one turn per trajectory: turn ratio == GSPO-token sequence ratio
        one_turn = torch.where(mask, 0, -1)
        seq = loss_and_grad(batch, ratio_level="sequence", **kw)
        turn = loss_and_grad(batch, ratio_level="turn", turn_id_BT=one_turn, **kw)
        close(turn[0], seq[0])
        close(turn[1], seq[1])
        # one token per turn: turn ratio == token ratio (value r, gradient r·∇log π)
        per_token = torch.where(mask, mask.long().cumsum(-1) - 1, -1)
        tok = loss_and_grad(batch, ratio_level="token", **kw)
        turn = loss_and_grad(batch, ratio_level="turn", turn_id_BT=per_token, **kw)
        assert 0 < tok[2]["pg_clipfrac"] < 1
        close(turn[0], tok[0])
        close(turn[1], tok[1])


def test_clip_fraction_by_turn():
    # turn ids [[0, 0, 1, −1], [0, 1, 1, 1]] on the hand batch (mask 0 at (0,3)).
    # clipped tokens: (0,0) turn 0 and (0,1) turn 0 -> turn 0: 2 of 3 ((0,0),(0,1),(1,0));
    # turn 1: 0 of 4 ((0,2),(1,1),(1,2),(1,3)).
    turn_id = torch.tensor([[0, 0, 1, -1], [0, 1, 1, 1]])
    _, diag, _ = run_hand(turn_id_BT=turn_id)
    assert set(diag["pg_clipfrac_by_turn"]) == {0, 1}
    close(diag["pg_clipfrac_by_turn"][0], 2 / 3)
    close(diag["pg_clipfrac_by_turn"][1], 0.0)


# --------------------------------------------------------------------------------------------
# split invariance: micro-batches and data-parallel ranks with global denominators


OPTION_SETS = {
    "plain": dict(),
    "dual_gp_adaptive": dict(dual_clip=3.0, upper_clip="gradient_preserving", scale=True),
}


@pytest.mark.parametrize("options", list(OPTION_SETS))
@pytest.mark.parametrize("ratio_level", L.RATIO_LEVELS)
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_split_invariance(agg_mode, ratio_level, options):
    # two ranks (rows 0–2, 3–5), each with two unequal micro-batches; each micro-batch gets the
    # mini-batch's global counts and dp_size=2, the micro losses are summed (accumulation) and
    # the ranks averaged (DDP all-reduce): value and gradients must equal the unsplit batch
    rank_micro = [[[0], [1, 2]], [[3, 4], [5]]]
    for seed in range(3):
        batch, turn_id, scale = random_batch(seed)
        opts = dict(OPTION_SETS[options])
        use_scale = opts.pop("scale", False)
        kw = dict(ratio_level=ratio_level, clip_low=0.1, clip_high=0.15, agg_mode=agg_mode,
                  norm_length=10.0, **opts)
        logp = batch["logp_BT"].detach().clone().requires_grad_(True)
        full, _ = L.policy_loss(**{**batch, "logp_BT": logp}, turn_id_BT=turn_id,
                                clip_scale_BT=scale if use_scale else None, **kw)
        (full_grad,) = torch.autograd.grad(full, logp)

        tokens, seqs = local_denominators(batch["mask_BT"])
        logp = batch["logp_BT"].detach().clone().requires_grad_(True)
        rank_losses = []
        for micros in rank_micro:
            total = 0.0
            for rows in micros:
                part = {k: v[rows] for k, v in batch.items()}
                part["logp_BT"] = logp[rows]
                micro, _ = L.policy_loss(**part, turn_id_BT=turn_id[rows],
                                         clip_scale_BT=scale[rows] if use_scale else None,
                                         global_tokens=tokens, global_seqs=seqs, dp_size=2,
                                         **kw)
                total = total + micro
            rank_losses.append(total)
        split = sum(rank_losses) / len(rank_losses)
        (split_grad,) = torch.autograd.grad(split, logp)
        close(split, full)
        close(split_grad, full_grad)


# --------------------------------------------------------------------------------------------
# KL estimators


def test_kl_penalty_hand_values():
    # d = log π − log π_ref = [1, −1, 0, 37]
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=D)
    ref = torch.tensor([[-2.0, -1.0, -0.5, -40.0]], dtype=D)
    close(L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind="k1"), [[1.0, -1.0, 0.0, 37.0]])
    close(L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind="abs"), [[1.0, 1.0, 0.0, 37.0]])
    close(L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind="k2"), [[0.5, 0.5, 0.0, 684.5]])
    # k3 = e^{−d} + d − 1: e^{−1}; e − 2; 0; e^{−37} + 36 -> clamped to 10
    k3 = [[math.exp(-1), math.e - 2, 0.0, 10.0]]
    close(L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind="k3"), k3)
    for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        close(L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind=alias),
              L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind=kind))
    with pytest.raises(ValueError, match="KL kind"):
        L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind="full")


def test_k3_nonnegative_and_finite_at_extremes():
    g = torch.Generator().manual_seed(0)
    logp = -5 * torch.rand(50, 20, generator=g, dtype=D)
    ref = logp + 20 * torch.randn(50, 20, generator=g, dtype=D)
    assert (L.kl_penalty(logp_BT=logp, ref_logp_BT=ref, kind="k3") >= 0).all()
    # log π = −inf (a token the policy can no longer produce): −d is clamped to 20 before exp,
    # so e^{20} − 20 − 1 -> 10 rather than inf − inf = NaN
    out = L.kl_penalty(logp_BT=torch.tensor([[-math.inf]], dtype=D),
                       ref_logp_BT=torch.zeros(1, 1, dtype=D), kind="k3")
    close(out, [[10.0]])


# --------------------------------------------------------------------------------------------
# entropy


def naive_entropy(logits):
    out = torch.zeros(logits.shape[:-1], dtype=D)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            z = [float(x) for x in logits[b, t]]
            zmax = max(z)
            norm = sum(math.exp(v - zmax) for v in z)
            p = [math.exp(v - zmax) / norm for v in z]
            out[b, t] = -sum(pi * math.log(pi) for pi in p if pi > 0)
    return out


def test_entropy_from_logprobs_matches_naive_loop_and_is_stable():
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 3, 5, generator=g, dtype=D)
    logp = lambda z: torch.log_softmax(z, dim=-1)  # noqa: E731 (what the log-prob pass gives)
    close(entropy_from_logprobs(logp_BTV=logp(logits)), naive_entropy(logits))
    # shift invariance at magnitudes where a naive exp overflows
    close(entropy_from_logprobs(logp_BTV=logp(logits + 1000.0)), naive_entropy(logits))
    # uniform over V = 5 -> log 5; one-hot (log p = 0 and -1e4) -> 0
    close(entropy_from_logprobs(logp_BTV=logp(torch.zeros(1, 1, 5, dtype=D))), [[math.log(5)]])
    close(entropy_from_logprobs(logp_BTV=logp(torch.tensor([[[0.0, -1e4]]], dtype=D))), [[0.0]])


def test_ppo_kl_unclamped_at_sequence_and_turn_level():
    # log π − log π_old per loss token: 25, −1, 0.5 (token 3 masked). verl clamps the token
    # log-ratio to ±20 (vanilla PPO) but reports GSPO's ppo_kl from the unclamped one:
    #   token level:        −(20 − 1 + 0.5)/3 = −19.5/3
    #   sequence, turn:     −(25 − 1 + 0.5)/3 = −24.5/3
    old = torch.zeros(1, 4, dtype=D)
    logp = torch.tensor([[25.0, -1.0, 0.5, 7.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    kw = dict(logp_BT=logp, old_logp_BT=old, adv_BT=torch.ones(1, 4, dtype=D), mask_BT=mask,
              clip_low=0.2, clip_high=0.2, agg_mode="token-mean",
              turn_id_BT=torch.tensor([[0, 0, 1, -1]]))
    close(L.policy_loss(ratio_level="token", **kw)[1]["ppo_kl"], -19.5 / 3)
    close(L.policy_loss(ratio_level="sequence", **kw)[1]["ppo_kl"], -24.5 / 3)
    close(L.policy_loss(ratio_level="turn", **kw)[1]["ppo_kl"], -24.5 / 3)


# --------------------------------------------------------------------------------------------
# AEPO entropy-aware advantage


def test_entropy_aware_advantage_hand_values():
    # masked entropies [1, 2, 3]: mean 2, unbiased std 1 -> z = [−1, 0, 1];
    # Ã = 2·(1 + 0.2·z) = [1.6, 2, 2.4]; the masked token (entropy 100) keeps A
    adv = torch.full((1, 4), 2.0, dtype=D)
    ent = torch.tensor([[1.0, 2.0, 100.0, 3.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0, 1]], dtype=D)
    close(L.entropy_aware_advantage(adv_BT=adv, entropy_BT=ent, mask_BT=mask),
          [[1.6, 2.0, 2.0, 2.4]])
    close(L.entropy_aware_advantage(adv_BT=adv, entropy_BT=ent, mask_BT=mask, alpha=0.5),
          [[1.0, 2.0, 2.0, 3.0]])


def test_entropy_aware_advantage_degenerate_cases_leave_advantages_unchanged():
    adv = torch.tensor([[1.0, -2.0, 0.5, 3.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    # equal entropies 0.1: their float mean is 0.1 + 2e-17, so a plain z-score would divide a
    # rounding residue by itself and give z = ±1; zero variance must mean z = 0
    ent = torch.tensor([[0.1, 0.1, 0.1, 7.0]], dtype=D)
    close(L.entropy_aware_advantage(adv_BT=adv, entropy_BT=ent, mask_BT=mask), adv)
    # a single loss token (unbiased std undefined) and no loss token at all
    one = torch.tensor([[0, 1, 0, 0]], dtype=D)
    close(L.entropy_aware_advantage(adv_BT=adv, entropy_BT=ent * 3, mask_BT=one), adv)
    close(L.entropy_aware_advantage(adv_BT=adv, entropy_BT=ent, mask_BT=torch.zeros(1, 4)), adv)


def test_entropy_aware_advantage_is_detached_from_entropy():
    ent = torch.tensor([[1.0, 2.0, 4.0]], dtype=D, requires_grad=True)
    out = L.entropy_aware_advantage(adv_BT=torch.ones(1, 3, dtype=D), entropy_BT=ent,
                                    mask_BT=torch.ones(1, 3))
    assert not out.requires_grad
