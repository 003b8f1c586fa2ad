"""Tree-GRPO and AT2PO tree advantages (a2tgpo.algo.tree): hand-worked cases, properties, and
the vectorised module against a naive recursive reference on random forests."""

import math
import random
import statistics
from collections import defaultdict

import pytest
import torch

from a2tgpo.algo.tree import (
    ADV_MODES,
    VALUE_MODES,
    at2po_node_advantages,
    at2po_node_values,
    leaf_turn_advantages,
    tree_grpo_advantages,
    tree_leaves,
)

F64 = torch.float64
NAN = float("nan")
EPS = 1e-6


def close(actual, expected):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=1e-6,
                               rtol=1e-5)


# --------------------------------------------------------------------------------------------
# naive reference: recursive Python over a dict tree, statistics module for the z-scores


def children_of(parent):
    kids = defaultdict(list)
    for n, p in enumerate(parent):
        if p >= 0:
            kids[p].append(n)
    return kids


def naive_values(parent, entropy, reward, tree, mode, leaf_norm, eps=EPS):
    kids = children_of(parent)
    leaves = [n for n in range(len(parent)) if not kids[n]]
    rhat = {n: reward[n] for n in leaves}
    if leaf_norm:
        for t in set(tree):
            own = [n for n in leaves if tree[n] == t]
            mu = statistics.fmean(reward[n] for n in own)
            sd = statistics.pstdev([reward[n] for n in own])
            for n in own:
                rhat[n] = (reward[n] - mu) / (sd + eps)

    def leaves_below(n):
        return [n] if not kids[n] else [x for c in kids[n] for x in leaves_below(c)]

    def value(n):
        if not kids[n]:
            return rhat[n]
        if mode == "leaf_mean":
            return statistics.fmean(rhat[x] for x in leaves_below(n))
        vals = [value(c) for c in kids[n]]
        hs = [entropy[c] for c in kids[n]]
        if mode == "child_softmax":
            w = [math.exp(h) for h in hs]
        elif mode == "child_weighted_linear" and sum(hs) > 0:
            w = hs
        else:  # child_mean, and the linear rule's fallback when Σ H = 0
            w = [1.0] * len(hs)
        return sum(wi * v for wi, v in zip(w, vals, strict=True)) / sum(w)

    return [value(n) for n in range(len(parent))]


def naive_advantages(V, parent, mode):
    out = []
    for n, p in enumerate(parent):
        root = n
        while parent[root] >= 0:
            root = parent[root]
        if p < 0 or mode == "node_value":
            out.append(V[n])
        elif mode == "diff_parent":
            out.append(V[n] - V[p])
        elif mode == "diff_global":
            out.append(V[n] - V[root])
        else:
            out.append((V[n] - V[root]) + (V[n] - V[p]))
    return out


def naive_paths(parent):
    """Non-root nodes root→leaf of every leaf, leaves ascending."""
    kids = children_of(parent)
    paths = []
    for leaf in (n for n in range(len(parent)) if not kids[n]):
        path, n = [], leaf
        while parent[n] >= 0:
            path.append(n)
            n = parent[n]
        paths.append(path[::-1])
    return paths


def naive_verl_z(x, group, eps=EPS):
    out = []
    for i, g in enumerate(group):
        members = [x[j] for j in range(len(x)) if group[j] == g]
        mu, sd = (0.0, 1.0) if len(members) == 1 else (statistics.fmean(members),
                                                         statistics.stdev(members))
        out.append((x[i] - mu) / (sd + eps))
    return out


def random_forest(rng):
    """1-3 trees of 2-14 nodes, numbered in a shuffled order (parents need not come first);
    NaN rewards at internal nodes, entropies sometimes exactly 0, tree labels not 0..T-1."""
    parent, tree = [], []
    for t in range(rng.randint(1, 3)):
        base = len(parent)
        parent.append(-1)
        tree.append(10 * t + 7)
        for i in range(1, rng.randint(2, 14)):
            # half chains, half random recursive tree: both deep and bushy shapes
            up = i - 1 if rng.random() < 0.5 else rng.randrange(i)
            parent.append(base + up)
            tree.append(10 * t + 7)
    N = len(parent)
    perm = list(range(N))
    rng.shuffle(perm)  # old node i becomes perm[i]
    new_parent = [0] * N
    new_tree = [0] * N
    for i in range(N):
        new_parent[perm[i]] = -1 if parent[i] < 0 else perm[parent[i]]
        new_tree[perm[i]] = tree[i]
    kids = children_of(new_parent)
    entropy = [0.0 if new_parent[n] < 0 or rng.random() < 0.3 else rng.uniform(0.0, 3.0)
               for n in range(N)]
    reward = [NAN if kids[n] else float(rng.choice([-1, 0, 1])) for n in range(N)]
    return new_parent, entropy, reward, new_tree


def as_tensors(parent, entropy, reward, tree):
    return (torch.tensor(parent), torch.tensor(entropy, dtype=F64),
            torch.tensor(reward, dtype=F64), torch.tensor(tree))


# --------------------------------------------------------------------------------------------
# hand-worked AT2PO tree
#
#        0 (root)
#       /        \
#   1 = A (leaf)  2 = B
#   r=+1, H=1     H=3
#                /      \
#           3 = C (leaf) 4 = D (leaf)
#           r=-1, H=0.5  r=0, H=1.5

PARENT = torch.tensor([-1, 0, 0, 2, 2])
ENTROPY = torch.tensor([0.0, 1.0, 3.0, 0.5, 1.5], dtype=F64)
REWARD = torch.tensor([NAN, 1.0, NAN, -1.0, 0.0], dtype=F64)
TREE = torch.zeros(5, dtype=torch.long)


def hand_values(mode, leaf_norm=False):
    return at2po_node_values(parent_N=PARENT, entropy_N=ENTROPY, leaf_reward_N=REWARD,
                             tree_N=TREE, value_mode=mode, leaf_norm=leaf_norm)


E = math.e
# Raw leaf values (leaf_norm=False): V_A = 1, V_C = -1, V_D = 0. Node order [0, A, B, C, D].
HAND_V = {
    # V_B = (-1 + 0)/2 = -0.5; V_0 = (1 + (-0.5))/2 = 0.25
    "child_mean": [0.25, 1.0, -0.5, -1.0, 0.0],
    # V_B = mean(C, D) = -0.5; V_0 = mean(A, C, D) = (1 - 1 + 0)/3 = 0 (differs from
    # child_mean: the unbalanced tree weighs A's subtree 1/2 there, 1/3 here)
    "leaf_mean": [0.0, 1.0, -0.5, -1.0, 0.0],
    # V_B = (0.5*(-1) + 1.5*0)/(0.5 + 1.5) = -0.25; V_0 = (1*1 + 3*(-0.25))/(1 + 3) = 0.0625
    "child_weighted_linear": [0.0625, 1.0, -0.25, -1.0, 0.0],
    # V_B = (e^0.5*(-1) + e^1.5*0)/(e^0.5 + e^1.5) = -1/(1 + e) ≈ -0.268941
    # V_0 = (e^1*1 + e^3*V_B)/(e^1 + e^3) = (1 + e^2 V_B)/(1 + e^2) ≈ -0.117680
    "child_softmax": [(1 - E**2 / (1 + E)) / (1 + E**2), 1.0, -1 / (1 + E), -1.0, 0.0],
}


@pytest.mark.parametrize("mode", VALUE_MODES)
def test_hand_tree_values(mode):
    close(hand_values(mode), HAND_V[mode])


@pytest.mark.parametrize("mode", VALUE_MODES)
def test_hand_tree_leaf_norm(mode):
    # Leaves r = (1, -1, 0): mean 0, population std sqrt(((1)^2 + (-1)^2 + 0^2)/3) = sqrt(2/3),
    # so r̂ = a·r with a = 1/(sqrt(2/3) + 1e-6) ≈ 1.224743. Every value mode is a weighted mean
    # of leaf values, hence linear in them: V(leaf_norm) = a·V(raw).
    a = 1 / (math.sqrt(2 / 3) + EPS)
    close(hand_values(mode, leaf_norm=True), [a * v for v in HAND_V[mode]])


# Advantages from the child_mean values V = [0.25, 1, -0.5, -1, 0] (root entry: V_0 = 0.25 in
# every mode, as the released code sets it).
HAND_A_MEAN = {
    "node_value": [0.25, 1.0, -0.5, -1.0, 0.0],
    # A: 1 - 0.25; B: -0.5 - 0.25; C: -1 - (-0.5); D: 0 - (-0.5)
    "diff_parent": [0.25, 0.75, -0.75, -0.5, 0.5],
    # minus V_0 = 0.25 each
    "diff_global": [0.25, 0.75, -0.75, -1.25, -0.25],
    # sum of the two rows above
    "diff_localglobal": [0.25, 1.5, -1.5, -1.75, 0.25],
}
# From the linear values V = [0.0625, 1, -0.25, -1, 0]:
HAND_A_LINEAR = {
    "node_value": [0.0625, 1.0, -0.25, -1.0, 0.0],
    # A: 1 - 0.0625; B: -0.25 - 0.0625; C: -1 + 0.25; D: 0 + 0.25
    "diff_parent": [0.0625, 0.9375, -0.3125, -0.75, 0.25],
    # minus V_0 = 0.0625 each
    "diff_global": [0.0625, 0.9375, -0.3125, -1.0625, -0.0625],
    "diff_localglobal": [0.0625, 1.875, -0.625, -1.8125, 0.1875],
}


@pytest.mark.parametrize("adv_mode", ADV_MODES)
@pytest.mark.parametrize("value_mode, table", [("child_mean", HAND_A_MEAN),
                                                ("child_weighted_linear", HAND_A_LINEAR)])
def test_hand_tree_advantages(adv_mode, value_mode, table):
    A = at2po_node_advantages(V_N=hand_values(value_mode), parent_N=PARENT, tree_N=TREE,
                              adv_mode=adv_mode)
    close(A, table[adv_mode])


def test_hand_tree_turn_lists():
    # Leaves ascending: A (1), C (3), D (4). Turns are the non-root nodes root→leaf:
    # A: [A]; C: [B, C]; D: [B, D]. With diff_parent child_mean advantages
    # [0.25, 0.75, -0.75, -0.5, 0.5]: [0.75], [-0.75, -0.5], [-0.75, 0.5].
    assert tree_leaves(PARENT).tolist() == [1, 3, 4]
    turns = leaf_turn_advantages(A_N=torch.tensor(HAND_A_MEAN["diff_parent"], dtype=F64),
                                 parent_N=PARENT)
    assert len(turns) == 3
    for got, want in zip(turns, [[0.75], [-0.75, -0.5], [-0.75, 0.5]], strict=True):
        close(got, want)


# --------------------------------------------------------------------------------------------
# Tree-GRPO by hand: prompt 0 has tree 0 with r = (1, 0, 0) and tree 1 with r = (1, 1, 0);
# prompt 1 has one tree with one leaf, r = 1 (verl singleton: mean 0, std 1).

REWARD_L = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0], dtype=F64)
TREE_L = torch.tensor([0, 0, 0, 1, 1, 1, 2])
PROMPT_L = torch.tensor([5, 5, 5, 5, 5, 5, 9])


def test_tree_grpo_sum_by_hand():
    # Prompt 5: mean 3/6 = 0.5, unbiased var 6·0.25/5 = 0.3, so z_p = ±0.5/(sqrt(0.3) + ε)
    # ≈ ±0.912870 (+ for r = 1).
    zp = 0.5 / (math.sqrt(0.3) + EPS)
    # Tree (1, 0, 0): mean 1/3, unbiased var ((2/3)^2 + 2(1/3)^2)/2 = 1/3, σ = 1/sqrt(3):
    # z_t = (2/3)/(σ + ε) ≈ 1.154701 for the 1, -(1/3)/(σ + ε) ≈ -0.577350 for the 0s.
    # Tree (1, 1, 0) mirrors it: z_t = (1/3)/(σ + ε) for the 1s, -(2/3)/(σ + ε) for the 0.
    s = 1 / math.sqrt(3) + EPS
    # Prompt 9 / tree 2, one leaf: z = (1 - 0)/(1 + ε) twice.
    single = 1 / (1 + EPS)
    expected = [zp + (2 / 3) / s, -zp - (1 / 3) / s, -zp - (1 / 3) / s,
                zp + (1 / 3) / s, zp + (1 / 3) / s, -zp - (2 / 3) / s,
                2 * single]
    close(tree_grpo_advantages(reward_L=REWARD_L, tree_L=TREE_L, prompt_L=PROMPT_L), expected)


def test_tree_grpo_two_stage_by_hand():
    # Stage 1 gives tree 0 the values (zp, -zp, -zp): mean -zp/3 and unbiased std
    # 2·zp/sqrt(3) (the (1, 0, 0) pattern scaled by 2·zp), so stage 2 gives
    # (4zp/3)/(2zp/sqrt(3) + ε) and (-2zp/3)/(2zp/sqrt(3) + ε); tree 1 mirrored.
    # The singleton goes through the (mean 0, std 1) rule twice: 1/(1 + ε)^2.
    zp = 0.5 / (math.sqrt(0.3) + EPS)
    s = 2 * zp / math.sqrt(3) + EPS
    expected = [(4 * zp / 3) / s, (-2 * zp / 3) / s, (-2 * zp / 3) / s,
                (2 * zp / 3) / s, (2 * zp / 3) / s, (-4 * zp / 3) / s,
                1 / (1 + EPS) ** 2]
    close(tree_grpo_advantages(reward_L=REWARD_L, tree_L=TREE_L, prompt_L=PROMPT_L,
                               mode="two_stage"), expected)


def test_tree_grpo_random_against_naive_and_identities():
    rng = random.Random(0)
    for _ in range(60):
        rewards, trees, prompts = [], [], []
        for p in range(rng.randint(1, 3)):
            for t in range(rng.randint(1, 3)):
                for _ in range(rng.randint(1, 4)):
                    rewards.append(float(rng.choice([-1, 0, 1])) + rng.uniform(-0.2, 0.2))
                    trees.append(100 * p + t)
                    prompts.append(p)
        r, tl, pl = torch.tensor(rewards, dtype=F64), torch.tensor(trees), torch.tensor(prompts)
        zp = naive_verl_z(rewards, prompts)
        zt = naive_verl_z(rewards, trees)
        close(tree_grpo_advantages(reward_L=r, tree_L=tl, prompt_L=pl),
              [a + b for a, b in zip(zp, zt, strict=True)])
        two = tree_grpo_advantages(reward_L=r, tree_L=tl, prompt_L=pl, mode="two_stage")
        close(two, naive_verl_z(zp, trees))
        # Identity documented in the module: for a tree of >= 2 leaves, z_tree(z_prompt(r)) =
        # (r - μ_t)/(σ_t + ε(σ_p + ε)), with σ_p taken as 1 for a one-leaf prompt.
        for i in range(len(rewards)):
            own_t = [rewards[j] for j in range(len(rewards)) if trees[j] == trees[i]]
            own_p = [rewards[j] for j in range(len(rewards)) if prompts[j] == prompts[i]]
            if len(own_t) < 2:
                continue
            sp = statistics.stdev(own_p) if len(own_p) > 1 else 1.0
            want = (rewards[i] - statistics.fmean(own_t)) / (
                statistics.stdev(own_t) + EPS * (sp + EPS))
            close(two[i], want)


def test_tree_grpo_sum_is_zero_per_prompt():
    # With every tree of >= 2 leaves both z-scores are centred per group, so their sum adds to
    # 0 over each prompt (and over each tree).
    r = torch.tensor([1.0, -1.0, 0.0, 1.0, 1.0, -1.0, 0.0, 0.0], dtype=F64)
    tl = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    pl = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    adv = tree_grpo_advantages(reward_L=r, tree_L=tl, prompt_L=pl)
    close(torch.stack([adv[pl == p].sum() for p in (0, 1)]), [0.0, 0.0])


def test_tree_grpo_rejects_tree_across_prompts():
    with pytest.raises(ValueError, match="one prompt"):
        tree_grpo_advantages(reward_L=torch.zeros(3, dtype=F64), tree_L=torch.tensor([0, 0, 1]),
                             prompt_L=torch.tensor([0, 1, 1]))


# --------------------------------------------------------------------------------------------
# AT2PO properties


def test_vectorised_matches_naive_on_random_forests():
    rng = random.Random(1234)
    for _ in range(80):
        parent, entropy, reward, tree = random_forest(rng)
        par, H, r, t = as_tensors(parent, entropy, reward, tree)
        depth = [len(p) for p in naive_paths(parent)]
        for mode in VALUE_MODES:
            for leaf_norm in (True, False):
                V = at2po_node_values(parent_N=par, entropy_N=H, leaf_reward_N=r, tree_N=t,
                                      value_mode=mode, leaf_norm=leaf_norm)
                V_ref = naive_values(parent, entropy, reward, tree, mode, leaf_norm)
                close(V, V_ref)
                for adv_mode in ADV_MODES:
                    A = at2po_node_advantages(V_N=V, parent_N=par, tree_N=t, adv_mode=adv_mode)
                    A_ref = naive_advantages(V_ref, parent, adv_mode)
                    close(A, A_ref)
                    turns = leaf_turn_advantages(A_N=A, parent_N=par)
                    assert [len(x) for x in turns] == depth
                    for got, path in zip(turns, naive_paths(parent), strict=True):
                        close(got, [A_ref[n] for n in path])


def test_identical_rewards_in_a_tree_give_zero_values():
    # leaf_norm z-scores within a tree: equal rewards give r - mean = 0, hence 0 at every leaf
    # and every weighted mean above it, whatever the rewards of other trees.
    rng = random.Random(7)
    for _ in range(20):
        parent, entropy, _, tree = random_forest(rng)
        const = {t: float(rng.choice([-1, 0, 1])) for t in set(tree)}
        kids = children_of(parent)
        reward = [NAN if kids[n] else const[tree[n]] for n in range(len(parent))]
        par, H, r, t = as_tensors(parent, entropy, reward, tree)
        for mode in VALUE_MODES:
            V = at2po_node_values(parent_N=par, entropy_N=H, leaf_reward_N=r, tree_N=t,
                                  value_mode=mode)
            close(V, torch.zeros(len(parent)))


def test_child_mean_equals_leaf_mean_on_full_binary_tree():
    # With every internal node having 2 children and all 8 leaves at depth 3, each subtree
    # holds the same number of leaves, so a mean of child means is the mean of the leaves.
    # (False in general: the hand tree gives V_0 = 0.25 vs 0.)
    parent = torch.tensor([-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6])
    g = torch.Generator().manual_seed(3)
    reward = torch.full((15,), NAN, dtype=F64)
    reward[7:] = torch.randint(-1, 2, (8,), generator=g).to(F64)
    H = torch.rand(15, generator=g, dtype=F64)
    t = torch.zeros(15, dtype=torch.long)
    kw = dict(parent_N=parent, entropy_N=H, leaf_reward_N=reward, tree_N=t)
    close(at2po_node_values(**kw, value_mode="child_mean"),
          at2po_node_values(**kw, value_mode="leaf_mean"))


def test_equal_entropies_reduce_to_child_mean():
    # Softmax of equal entropies is uniform; linear weights h/Σh with equal h are uniform; and
    # all-zero entropies take the linear rule's fallback, the plain mean.
    rng = random.Random(11)
    for _ in range(10):
        parent, _, reward, tree = random_forest(rng)
        par, _, r, t = as_tensors(parent, [0.0] * len(parent), reward, tree)
        mean = at2po_node_values(parent_N=par, entropy_N=torch.zeros(len(parent), dtype=F64),
                                 leaf_reward_N=r, tree_N=t, value_mode="child_mean")
        for h, mode in [(0.7, "child_softmax"), (0.7, "child_weighted_linear"),
                        (0.0, "child_weighted_linear")]:
            H = torch.full((len(parent),), h, dtype=F64)
            close(at2po_node_values(parent_N=par, entropy_N=H, leaf_reward_N=r, tree_N=t,
                                    value_mode=mode), mean)


def test_softmax_survives_large_entropies():
    # exp(800) overflows float64; only the difference of sibling entropies matters.
    H = ENTROPY + 800.0
    V = at2po_node_values(parent_N=PARENT, entropy_N=H, leaf_reward_N=REWARD, tree_N=TREE,
                          value_mode="child_softmax", leaf_norm=False)
    close(V, HAND_V["child_softmax"])


def test_diff_parent_telescopes_along_each_path():
    # Σ_k (V_k − V_{k−1}) over a leaf's turns = V_leaf − V_root.
    rng = random.Random(5)
    parent, entropy, reward, tree = random_forest(rng)
    par, H, r, t = as_tensors(parent, entropy, reward, tree)
    V = at2po_node_values(parent_N=par, entropy_N=H, leaf_reward_N=r, tree_N=t,
                          value_mode="child_softmax")
    A = at2po_node_advantages(V_N=V, parent_N=par, tree_N=t, adv_mode="diff_parent")
    for turns, path in zip(leaf_turn_advantages(A_N=A, parent_N=par), naive_paths(parent),
                           strict=True):
        root = parent[path[0]]
        close(turns.sum(), V[path[-1]] - V[root])


@pytest.mark.parametrize("parent, tree, match", [
    ([-1, 2, 1], [0, 0, 0], "cycle"),
    ([-1, 0, -1], [0, 0, 1], "at least one child"),
    ([-1, 0, 0], [0, 0, 1], "constant"),
    ([-1, 0, -1, 2], [0, 0, 0, 0], "share a tree label"),
    ([-1, 5], [0, 0], "-1..N-1"),
])
def test_malformed_forests_are_rejected(parent, tree, match):
    n = len(parent)
    with pytest.raises(ValueError, match=match):
        at2po_node_values(parent_N=torch.tensor(parent), entropy_N=torch.ones(n, dtype=F64),
                          leaf_reward_N=torch.zeros(n, dtype=F64), tree_N=torch.tensor(tree),
                          value_mode="child_mean")


def test_linear_weights_reject_negative_entropy():
    H = ENTROPY.clone()
    H[3] = -0.5
    with pytest.raises(ValueError, match="non-negative"):
        at2po_node_values(parent_N=PARENT, entropy_N=H, leaf_reward_N=REWARD, tree_N=TREE,
                          value_mode="child_weighted_linear")
