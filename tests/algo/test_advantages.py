"""Advantage estimators: hand-derived cases, properties, naive-loop equivalence, App. D analyses."""

import math
import random

import pytest
import torch

from a2tgpo.algo.advantages import (
    anchor_clusters,
    dynamic_sampling_keep,
    gigpo_advantages,
    grpo_advantages,
    igpo_family_advantages,
    overlong_penalty,
)

D = torch.float64
EPS = 1e-6


def t(x):
    return torch.tensor(x, dtype=D)


# --------------------------------------------------------------------------------------------
# GRPO / Dr.GRPO / DAPO


def test_grpo_by_hand():
    # group a: rewards 1,0,0,1 -> mean 0.5; unbiased var = 4·0.25/3 = 1/3, std = sqrt(1/3)
    # group b: one member -> verl uses mean 0, std 1: A = 2/(1+eps)
    adv = grpo_advantages(reward_B=t([1, 0, 0, 1, 2]), group_B=["a", "a", "a", "a", "b"])
    s = math.sqrt(1 / 3)
    torch.testing.assert_close(adv, t([0.5 / (s + EPS), -0.5 / (s + EPS), -0.5 / (s + EPS),
                                       0.5 / (s + EPS), 2 / (1 + EPS)]), atol=1e-9, rtol=0)
    # Dr.GRPO: mean only
    adv = grpo_advantages(reward_B=t([1, 0, 0, 1, 2]), group_B=[0, 0, 0, 0, 1], norm_std=False)
    torch.testing.assert_close(adv, t([0.5, -0.5, -0.5, 0.5, 2.0]), atol=1e-12, rtol=0)


def test_grpo_properties():
    g = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(0))
    r = torch.randn(64, dtype=D, generator=torch.Generator().manual_seed(1))
    adv = grpo_advantages(reward_B=r, group_B=g)
    for k in g.unique():
        sel = g == k
        if sel.sum() > 1:
            assert abs(adv[sel].sum().item()) < 1e-9  # centred per group
    same = grpo_advantages(reward_B=t([0.7] * 4), group_B=[0] * 4)
    assert same.abs().max().item() == 0.0  # identical rewards -> no signal


def test_dynamic_sampling_keep():
    # a: equal metric -> dropped; b: spread -> kept; c: a group of one is kept (verl)
    keep = dynamic_sampling_keep(metric_B=t([1, 1, 0, 1, 5]), group_B=["a", "a", "b", "b", "c"])
    assert keep.tolist() == [False, False, True, True, True]


def test_overlong_penalty():
    # L_max 100, buffer 20: free up to 80, then −1 per 20 tokens
    p = overlong_penalty(length_B=t([50, 80, 90, 100, 110]), max_length=100, buffer_length=20)
    torch.testing.assert_close(p, t([0, 0, -0.5, -1.0, -1.5]), atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        overlong_penalty(length_B=t([1]), max_length=10, buffer_length=0)


# --------------------------------------------------------------------------------------------
# IGPO family: the worked example
#   τ1: 3 turns (2 tool calls), ig = [0.2, 0.4], R = 1
#   τ2: 2 turns (1 tool call),  ig = [0.0],      R = 0
#   τ3: 1 turn (answers at once),                R = 0


def example():
    return dict(ig_BK=t([[0.2, 0.4, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
                ig_mask_BK=torch.ones(3, 3, dtype=torch.bool),
                num_turns_B=torch.tensor([3, 2, 1]), outcome_B=t([1, 0, 0]), group_B=[0, 0, 0])


def test_a2tgpo_by_hand():
    adv, clip, ig_hat = igpo_family_advantages(**example(), beta=0.3)
    # turn group 0 = {0.2 (τ1), 0.0 (τ2)}: mean 0.1, population std 0.1 -> ±0.1/(0.1+eps)
    z = 0.1 / (0.1 + EPS)
    # turn group 1 = {0.4} alone -> 0
    torch.testing.assert_close(ig_hat, t([[z, 0, 0], [-z, 0, 0], [0, 0, 0]]), atol=1e-12, rtol=0)
    # outcomes 1,0,0: mean 1/3, population std sqrt(2/9)
    sd = math.sqrt(2 / 9)
    r1, r0 = (2 / 3) / (sd + EPS), (-1 / 3) / (sd + EPS)
    # τ1 turn 0: D = z + 0 over n = 2 IG terms -> z/√2 + R̂; turn 1: D = 0, n = 1; final: R̂
    # τ2 turn 0: D = −z, n = 1; final: R̂.  τ3: final only.
    expected = t([[z / math.sqrt(2) + r1, r1, r1], [-z + r0, r0, 0], [r0, 0, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=0)
    # c = 1 + 0.3(2σ(îg) − 1): τ1 turn 0 uses z, turn 1 uses 0 -> 1; τ2 turn 0 uses −z
    c = lambda x: 1 + 0.3 * (2 / (1 + math.exp(-x)) - 1)  # noqa: E731
    torch.testing.assert_close(clip, t([[c(z), 1, 1], [c(-z), 1, 1], [1, 1, 1]]), atol=1e-12,
                               rtol=0)


def test_release_process_weight():
    adv, _, _ = igpo_family_advantages(**example(), process_weight=0.3)
    sd = math.sqrt(2 / 9)
    z, r1 = 0.1 / (0.1 + EPS), (2 / 3) / (sd + EPS)
    assert abs(adv[0, 0].item() - (0.3 * z / math.sqrt(2) + r1)) < 1e-9


def test_igpo_joint_by_hand():
    # one pool: IG {0.2, 0.4, 0.0} and outcomes {1, 0, 0}: mean 1.6/6,
    # population var = (0.04 + 0.16 + 1)/6 − (1.6/6)² -> z(x) = (x − μ)/(σ + eps)
    mu = 1.6 / 6
    sd = math.sqrt(1.2 / 6 - mu ** 2)
    z = lambda x: (x - mu) / (sd + EPS)  # noqa: E731
    adv, clip, _ = igpo_family_advantages(**example(), ig_norm="joint", outcome_mode="discounted",
                                          sqrt_rescale=False, beta=0.0, gamma=0.5)
    # Ã_t = Σ_{k=t}^{T−1} γ^{k−t} r̃_k with the outcome as the last reward
    expected = t([[z(0.2) + 0.5 * z(0.4) + 0.25 * z(1), z(0.4) + 0.5 * z(1), z(1)],
                  [z(0.0) + 0.5 * z(0), z(0), 0],
                  [z(0), 0, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-9, rtol=0)
    assert (clip == 1).all()  # beta 0: no adaptive clip


def test_separate_pools_ig_over_all_turns():
    # IG pool per prompt {0.2, 0.4, 0.0}: mean 0.2, population std sqrt(0.08/3)
    _, _, ig_hat = igpo_family_advantages(**example(), ig_norm="separate")
    sd = math.sqrt(0.08 / 3)
    torch.testing.assert_close(ig_hat[0, :2], t([0.0, 0.2 / (sd + EPS)]), atol=1e-9, rtol=0)
    assert abs(ig_hat[1, 0].item() - (-0.2 / (sd + EPS))) < 1e-9


def test_first_turn_without_ig_accumulates_later_terms():
    ex = example()
    ex["ig_mask_BK"] = torch.tensor([[False, True, True]] * 3)  # released code: no first IG
    adv, clip, ig_hat = igpo_family_advantages(**ex, ig_norm="none", beta=0.3)
    sd = math.sqrt(2 / 9)
    r1, r0 = (2 / 3) / (sd + EPS), (-1 / 3) / (sd + EPS)
    # τ1: turn 0 has no IG of its own: D = 0.4 over n = 1 term; turn 1: D = 0.4, n = 1
    torch.testing.assert_close(adv[0], t([0.4 + r1, 0.4 + r1, r1]), atol=1e-9, rtol=0)
    # τ2: its only tool call has no IG -> outcome only
    torch.testing.assert_close(adv[1, :2], t([r0, r0]), atol=1e-9, rtol=0)
    assert clip[0, 0].item() == 1.0 and clip[1, 0].item() == 1.0


# --------------------------------------------------------------------------------------------
# properties and naive-loop equivalence


def random_batch(seed, n_groups=4, G=5, K=6):
    g = torch.Generator().manual_seed(seed)
    B = n_groups * G
    num_turns = torch.randint(1, K + 1, (B,), generator=g)
    return dict(ig_BK=torch.randn(B, K, dtype=D, generator=g),
                ig_mask_BK=torch.rand(B, K, generator=g) > 0.15,
                num_turns_B=num_turns, outcome_B=torch.randint(-1, 2, (B,), generator=g).to(D),
                group_B=[b // G for b in range(B)])


def naive(ig_BK, ig_mask_BK, num_turns_B, outcome_B, group_B, ig_norm, outcome_mode, gamma,
          sqrt_rescale, process_weight, beta, eps=EPS):
    """Direct transcription of the equations with Python loops (the reference)."""
    B, K = ig_BK.shape
    T = num_turns_B.tolist()
    has = [[k < T[b] - 1 and bool(ig_mask_BK[b, k]) for k in range(K)] for b in range(B)]

    def z(vals):
        if len(vals) <= 1:
            return [0.0] * len(vals)
        m = sum(vals) / len(vals)
        s = math.sqrt(sum((v - m) ** 2 for v in vals) / len(vals))
        return [(v - m) / (s + eps) for v in vals]

    ig_hat = [[0.0] * K for _ in range(B)]
    r_hat = [0.0] * B
    for grp in set(group_B):
        members = [b for b in range(B) if group_B[b] == grp]
        cells = [(b, k) for b in members for k in range(K) if has[b][k]]
        if ig_norm == "joint":
            zs = z([float(ig_BK[b, k]) for b, k in cells] + [float(outcome_B[b]) for b in members])
            # strict=False: zs is the cells' z-scores then the members'; this takes the first part
            for (b, k), v in zip(cells, zs, strict=False):
                ig_hat[b][k] = v
            for b, v in zip(members, zs[len(cells):], strict=True):
                r_hat[b] = v
            continue
        for b, v in zip(members, z([float(outcome_B[b]) for b in members]), strict=True):
            r_hat[b] = v
        if ig_norm == "separate":
            for (b, k), v in zip(cells, z([float(ig_BK[b, k]) for b, k in cells]), strict=True):
                ig_hat[b][k] = v
        elif ig_norm == "turn_group":
            for k in range(K):
                col = [(b, kk) for b, kk in cells if kk == k]
                for (b, kk), v in zip(col, z([float(ig_BK[b, kk]) for b, kk in col]), strict=True):
                    ig_hat[b][kk] = v
        else:
            for b, k in cells:
                ig_hat[b][k] = float(ig_BK[b, k])
    adv = [[0.0] * K for _ in range(B)]
    clip = [[1.0] * K for _ in range(B)]
    for b in range(B):
        last = T[b] - 1
        for k in range(T[b]):
            if k == last:
                adv[b][k] = r_hat[b]
                continue
            terms = [(j, ig_hat[b][j]) for j in range(k, last) if has[b][j]]
            Dk = sum(gamma ** (j - k) * v for j, v in terms)
            n = len(terms)
            proc = process_weight * Dk / (math.sqrt(n) if sqrt_rescale else 1) if n else 0.0
            w = gamma ** (last - k) if outcome_mode == "discounted" else 1.0
            adv[b][k] = proc + w * r_hat[b]
            if has[b][k]:
                clip[b][k] = 1 + beta * (2 / (1 + math.exp(-ig_hat[b][k])) - 1)
    return t(adv), t(clip)


FLAGS = [
    dict(ig_norm="joint", outcome_mode="discounted", gamma=1.0, sqrt_rescale=False,
         process_weight=1.0, beta=0.0),                                     # IGPO
    dict(ig_norm="separate", outcome_mode="discounted", gamma=0.9, sqrt_rescale=False,
         process_weight=1.0, beta=0.0),                                     # IGPO code
    dict(ig_norm="turn_group", outcome_mode="added", gamma=1.0, sqrt_rescale=False,
         process_weight=1.0, beta=0.0),                                     # + turn-group
    dict(ig_norm="turn_group", outcome_mode="added", gamma=1.0, sqrt_rescale=True,
         process_weight=1.0, beta=0.0),                                     # + √n
    dict(ig_norm="turn_group", outcome_mode="added", gamma=1.0, sqrt_rescale=True,
         process_weight=1.0, beta=0.3),                                     # A2TGPO
    dict(ig_norm="turn_group", outcome_mode="added", gamma=0.8, sqrt_rescale=True,
         process_weight=0.3, beta=0.5),
    dict(ig_norm="none", outcome_mode="discounted", gamma=0.7, sqrt_rescale=True,
         process_weight=2.0, beta=0.1),
]


@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("seed", range(8))
def test_vectorised_equals_naive(flags, seed):
    batch = random_batch(seed)
    adv, clip, _ = igpo_family_advantages(**batch, **flags)
    ref_adv, ref_clip = naive(**batch, **flags)
    torch.testing.assert_close(adv, ref_adv, atol=1e-9, rtol=0)
    torch.testing.assert_close(clip, ref_clip, atol=1e-12, rtol=0)


def test_masked_ig_values_never_matter():
    batch = random_batch(3)
    adv, clip, _ = igpo_family_advantages(**batch)
    junk = batch["ig_BK"].clone()
    junk[~batch["ig_mask_BK"]] = float("nan")  # absent IG, even NaN, changes nothing
    K = junk.shape[1]
    beyond = torch.arange(K)[None, :] >= (batch["num_turns_B"][:, None] - 1)
    junk[beyond] = 1e6  # nor do values at the final turn or past it
    adv2, clip2, _ = igpo_family_advantages(**{**batch, "ig_BK": junk})
    torch.testing.assert_close(adv, adv2, atol=0, rtol=0)
    torch.testing.assert_close(clip, clip2, atol=0, rtol=0)


def test_zero_ig_reduces_to_outcome_on_every_turn():
    batch = random_batch(5)
    batch["ig_BK"] = torch.zeros_like(batch["ig_BK"])
    adv, clip, _ = igpo_family_advantages(**batch)
    r_hat = igpo_family_advantages(**{**batch, "num_turns_B": torch.ones_like(
        batch["num_turns_B"])})[0][:, 0]
    exists = torch.arange(adv.shape[1])[None, :] < batch["num_turns_B"][:, None]
    torch.testing.assert_close(adv, torch.where(exists, r_hat[:, None].expand_as(adv),
                                                torch.zeros_like(adv)), atol=1e-12, rtol=0)
    assert (clip == 1).all()  # σ(0) = 1/2 -> c = 1


def test_turn_group_normalisation_statistics():
    batch = random_batch(7, n_groups=6, G=8)
    _, _, ig_hat = igpo_family_advantages(**batch)
    T = batch["num_turns_B"]
    has = batch["ig_mask_BK"] & (torch.arange(6)[None, :] < (T[:, None] - 1))
    groups = torch.tensor(batch["group_B"])
    checked = 0
    for g in range(6):
        for k in range(6):
            sel = (groups == g) & has[:, k]
            vals = ig_hat[sel, k]
            if len(vals) >= 2 and batch["ig_BK"][sel, k].std() > 1e-3:
                assert abs(vals.mean().item()) < 1e-9
                # population std 1 (eps 1e-6 in the denominator costs < 1e-5 relative)
                assert abs(vals.std(unbiased=False).item() - 1) < 1e-4
                checked += 1
            elif len(vals) == 1:
                assert vals.item() == 0.0
    assert checked > 10


def test_clip_scale_bounds_and_monotone():
    beta = 0.3
    batch = random_batch(11)
    # |îg| up to ~15: large, yet σ stays below 1 in float64 (σ(40) rounds to exactly 1)
    batch["ig_BK"] = batch["ig_BK"] * 5
    _, clip, ig_hat = igpo_family_advantages(**batch, ig_norm="none", beta=beta)
    assert ((clip > 1 - beta) & (clip < 1 + beta)).all()
    has = clip != 1
    x, c = ig_hat[has], clip[has]
    order = torch.argsort(x)
    assert (c[order].diff() >= 0).all()


# --------------------------------------------------------------------------------------------
# A2TGPO appendix D analyses


def test_appendix_d_pooled_vs_turn_group_position_means():
    """Position-dependent IG means: a pooled z-score keeps a per-position bias, turn-groups
    don't."""
    g = torch.Generator().manual_seed(0)
    n_groups, G, K = 200, 8, 4
    B = n_groups * G
    # every rollout makes 3 tool calls; IG at turn k has mean k (later turns gain more)
    ig = torch.randn(B, K, dtype=D, generator=g) * 0.5 + torch.arange(K, dtype=D)[None, :]
    batch = dict(ig_BK=ig, ig_mask_BK=torch.ones(B, K, dtype=torch.bool),
                 num_turns_B=torch.full((B,), 4), outcome_B=torch.zeros(B, dtype=D),
                 group_B=[b // G for b in range(B)])
    _, _, pooled = igpo_family_advantages(**batch, ig_norm="separate")
    _, _, grouped = igpo_family_advantages(**batch, ig_norm="turn_group")
    pooled_means = pooled[:, :3].mean(0)
    grouped_means = grouped[:, :3].mean(0)
    # pooled: turn means 0,1,2 around a pool mean of 1, over a std ≈ sqrt(2/3 + 0.25) -> ≈ ∓1.04
    assert pooled_means[0] < -0.9 and pooled_means[2] > 0.9
    assert grouped_means.abs().max() < 1e-9


def test_appendix_d_sqrt_rescaling_keeps_variance_constant():
    """Independent unit-variance îg: Var(D_t) grows with the number of terms, Var(D_t/√n) ≈ 1."""
    g = torch.Generator().manual_seed(1)
    B, K = 20000, 7
    batch = dict(ig_BK=torch.randn(B, K, dtype=D, generator=g),
                 ig_mask_BK=torch.ones(B, K, dtype=torch.bool), num_turns_B=torch.full((B,), K),
                 outcome_B=torch.zeros(B, dtype=D), group_B=[0] * B)
    common = dict(ig_norm="none", outcome_mode="added", gamma=1.0, beta=0.0)
    raw, _, _ = igpo_family_advantages(**batch, sqrt_rescale=False, **common)
    scaled, _, _ = igpo_family_advantages(**batch, sqrt_rescale=True, **common)
    for tt in range(K - 1):
        n = K - 1 - tt  # terms accumulated at turn tt
        # Var(D) = n; Var(D/√n) = 1; 20k samples: relative error of a variance ≈ sqrt(2/20k) = 1%
        assert abs(raw[:, tt].var().item() / n - 1) < 0.05
        assert abs(scaled[:, tt].var().item() - 1) < 0.05


# --------------------------------------------------------------------------------------------
# GiGPO


def test_gigpo_by_hand():
    # one prompt, two rollouts of 2 steps; anchors: the question, then the latest observation
    anchors = [["q", "obs A"], ["q", "obs B"]]
    kw = dict(episode_reward_B=t([1, 0]), group_B=[0, 0], num_turns_B=torch.tensor([2, 2]),
              anchors=anchors, gamma=0.95)
    adv = gigpo_advantages(**kw)
    # A^E: step-sample pool {1, 1, 0, 0}: mean 0.5, unbiased std sqrt(1/3)
    ae = 0.5 / (math.sqrt(1 / 3) + EPS)
    # returns: τ1 (0.95, 1), τ2 (0, 0). Cluster "q" = {0.95, 0}: mean 0.475, unbiased std
    # 0.475·√2 -> A^S = ±0.475/(0.475√2 + eps); clusters "obs A", "obs B" are singletons -> 0
    a_s = 0.475 / (0.475 * math.sqrt(2) + EPS)
    torch.testing.assert_close(adv, t([[ae + a_s, ae], [-ae - a_s, -ae]]), atol=1e-9, rtol=0)
    # similarity: ratio("obs A", "obs B") = 2·4/10 = 0.8 -> merged at threshold 0.75, so the
    # second steps form a cluster {1, 0}: A^S = ±0.5/(0.5√2 + eps)
    merged = gigpo_advantages(**kw, similarity_threshold=0.75)
    a_s2 = 0.5 / (0.5 * math.sqrt(2) + EPS)
    torch.testing.assert_close(merged[:, 1], t([ae + a_s2, -ae - a_s2]), atol=1e-9, rtol=0)
    torch.testing.assert_close(gigpo_advantages(**kw, similarity_threshold=0.9), adv)
    # ω scales the step part; mean_norm drops the std
    half = gigpo_advantages(**kw, omega=0.5, mode="mean_norm")
    torch.testing.assert_close(half[0], t([0.5 + 0.5 * 0.475, 0.5]), atol=1e-12, rtol=0)


def test_anchor_clusters_greedy_first_match():
    assert anchor_clusters(["a", "b", "a", "c", "b"], None) == [0, 1, 0, 2, 1]
    # "abcd" ~ "abce" (ratio 0.75) joins cluster 0; "xyz" starts a new one
    assert anchor_clusters(["abcd", "abce", "xyz"], 0.7) == [0, 0, 1]


def test_gigpo_vs_naive_random():
    rnd = random.Random(0)
    for _ in range(5):
        B = 12
        T = [rnd.randint(1, 4) for _ in range(B)]
        groups = [b // 4 for b in range(B)]
        anchors = [["q"] + [rnd.choice(["x", "y", "z"]) for _ in range(T[b] - 1)]
                   for b in range(B)]
        R = [float(rnd.randint(-1, 1)) for _ in range(B)]
        adv = gigpo_advantages(episode_reward_B=t(R), group_B=groups,
                               num_turns_B=torch.tensor(T), anchors=anchors, gamma=0.9)

        def z(vals, x):  # verl statistics: unbiased, singleton -> mean 0, std 1
            if len(vals) <= 1:
                return x
            m = sum(vals) / len(vals)
            s = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
            return (x - m) / (s + EPS)

        for b in range(B):
            pool = [R[c] for c in range(B) if groups[c] == groups[b] for _ in range(T[c])]
            ae = z(pool, R[b])
            for k in range(T[b]):
                ret = lambda c, j, T=T, R=R: 0.9 ** (T[c] - 1 - j) * R[c]  # noqa: E731
                cl = [ret(c, j) for c in range(B) if groups[c] == groups[b]
                      for j in range(T[c]) if anchors[c][j] == anchors[b][k]]
                a_s = 0.0 if len(cl) <= 1 else z(cl, ret(b, k))
                assert abs(adv[b, k].item() - (ae + a_s)) < 1e-9


def test_group_index_and_segment_stats_by_hand():
    from a2tgpo.algo.advantages import group_index, segment_stats

    inv, G = group_index(["b", "a", "b", "c"])  # first-appearance order: b=0, a=1, c=2
    assert inv.tolist() == [0, 1, 0, 2] and G == 3
    inv_t, G_t = group_index(torch.tensor([7, 3, 7]))  # tensors: sorted unique values
    assert inv_t.tolist() == [1, 0, 1] and G_t == 2
    x = t([1.0, 5.0, 3.0, 4.0])
    # segment 0 = {1, 3}: mean 2, population std 1, unbiased std sqrt(2); others are singletons
    mean, std, count = segment_stats(x, inv, G, unbiased=False)
    assert mean.tolist() == [2.0, 5.0, 2.0, 4.0] and count.tolist() == [2, 1, 2, 1]
    assert std.tolist() == [1.0, 0.0, 1.0, 0.0]
    _, std_u, _ = segment_stats(x, inv, G, unbiased=True)
    assert abs(std_u[0].item() - math.sqrt(2)) < 1e-12 and math.isnan(std_u[1].item())
