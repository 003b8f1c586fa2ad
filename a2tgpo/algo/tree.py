"""Tree advantages (pure torch): Tree-GRPO (arXiv 2509.21240) and AT2PO's turn-wise credit
assignment (arXiv 2601.04767 §3, Eq. 3; algorithms.md §7.1, §8.1–8.2).

Trees come in a flat, framework-agnostic form. Nodes are numbered 0..N−1 in any order (a
parent may have a larger number than its child); `parent_N[n]` is n's parent, −1 for a root;
`tree_N[n]` names n's tree. A leaf is a node with no children, and each leaf is one trajectory:
the path root→leaf, whose k-th non-root node is turn k (AT2PO: a non-root node holds the
observation of its parent's tool call and its own generated turn; the root holds the prompt
only, so it has no tokens of its own and its advantage never reaches the loss).

Shape legend: the house letters plus N (nodes, all trees of the batch together) and L (leaves,
i.e. trajectories, ascending node number as `tree_leaves` returns them).

Decisions, and where paper and code differ:
  * Tree-GRPO (code `verl/trainer/ppo/ray_trainer_ts.py: compute_advantage` with
    `core_algos.compute_grpo_outcome_advantage` / `compute_tree_grpo_outcome_advantage`):
    estimator "tree" adds two independent verl GRPO z-scores, over the prompt's leaves and over
    the tree's leaves; "tree_2norm" z-scores by prompt, then z-scores that result by tree.
    Both use the unbiased std, eps 1e-6 added to the std, and a group of one gets mean 0 and
    std 1. Since a tree's leaves share one prompt, the second stage undoes the first up to eps:
    two_stage = (r − μ_tree) / (σ_tree + eps·(σ_prompt + eps)), essentially tree-only GRPO.
  * AT2PO node values: the paper weighs children linearly by entropy, w_c = H(c)/Σ H (Eq. 3);
    the released code (`vllm_rollout_with_tools_tree_offline.py: compute_value_from_children`,
    run with `node_value_mode=child_softmax`) uses softmax(H). Both are offered. The paper
    leaves Σ H = 0 undefined; here such a node falls back to the plain mean of its children
    (the limit of equal entropies). Linear weights need H >= 0, which Monte-Carlo entropies
    (mean −log π of sampled tokens) are.
  * Leaf normalisation (code, `leaf_value_norm=True`): per tree, (r − mean)/(std + eps) with
    the population std (np.std) and eps 1e-6 outside the square root; a tree whose leaves all
    have the same reward gets 0 everywhere.
  * Root advantage: the code sets it to V_root in every `node_adv_mode`, including the diff
    modes; kept, although no token uses it.
  * Duplicated leaves (AT2PO prunes or duplicates to 22 leaves per tree): the code duplicates
    by adding copies of the last leaf as new sibling leaves (same parent, entropy, reward).
    Do the same upstream: list each copy as its own leaf node. Copies then count once each in
    the leaf z-score, the child weights and the leaf means, as in the code, and share values.
"""

from __future__ import annotations

from typing import Literal

import torch

ValueMode = Literal["child_weighted_linear", "child_softmax", "child_mean", "leaf_mean"]
AdvMode = Literal["node_value", "diff_parent", "diff_global", "diff_localglobal"]
VALUE_MODES: tuple[str, ...] = ("child_weighted_linear", "child_softmax", "child_mean",
                                "leaf_mean")
ADV_MODES: tuple[str, ...] = ("node_value", "diff_parent", "diff_global", "diff_localglobal")


def _group_z(x: torch.Tensor, group: torch.Tensor, *, eps: float, unbiased: bool
             ) -> torch.Tensor:
    """(x − mean_g)/(std_g + eps) within each group label.

    unbiased=True is verl's GRPO: Bessel-corrected std, and a group of one has mean 0, std 1.
    unbiased=False is AT2PO's leaf norm: population std, so a group of one gives 0.
    """
    _, g = torch.unique(group, return_inverse=True)
    G = int(g.max()) + 1
    zeros = torch.zeros(G, dtype=x.dtype, device=x.device)
    count = zeros.index_add(0, g, torch.ones_like(x))
    mean = zeros.index_add(0, g, x) / count
    sq = zeros.index_add(0, g, (x - mean[g]) ** 2)
    if unbiased:
        std = torch.sqrt(sq / (count - 1).clamp(min=1))
        single = count == 1
        mean = torch.where(single, torch.zeros_like(mean), mean)
        std = torch.where(single, torch.ones_like(std), std)
    else:
        std = torch.sqrt(sq / count)
    return (x - mean[g]) / (std[g] + eps)


def tree_grpo_advantages(*, reward_L: torch.Tensor, tree_L: torch.Tensor,
                         prompt_L: torch.Tensor, eps: float = 1e-6,
                         mode: Literal["sum", "two_stage"] = "sum") -> torch.Tensor:
    """Tree-GRPO outcome advantage of each leaf (arXiv 2509.21240; algorithms.md §7.1).

    mode "sum" (code estimator `tree`):
        A = z_prompt(r) + z_tree(r),
    the inter-tree (all leaves of the prompt, M·K of them) plus the intra-tree (the K leaves
    of the tree) GRPO advantage. mode "two_stage" (code estimator `tree_2norm`):
        A = z_tree(z_prompt(r)).
    z is verl's GRPO z-score: unbiased std, `eps` added to the std, a group of one has mean 0
    and std 1 (so z = r/(1 + eps)). The advantage is per trajectory; broadcasting it to the
    trajectory's tokens is the caller's job. Shared prefixes get credit implicitly, through
    the sum of the gradients of the sequences that contain them.

    Args:
      reward_L: outcome reward of each leaf (trajectory).
      tree_L: tree label of each leaf; every tree belongs to one prompt.
      prompt_L: prompt (group) label of each leaf.
    Shapes: reward_L, tree_L, prompt_L (L,) -> adv_L (L,).
    """
    if mode not in ("sum", "two_stage"):
        raise ValueError(f"mode must be 'sum' or 'two_stage', got {mode!r}")
    _, t = torch.unique(tree_L, return_inverse=True)
    # one member's prompt per tree (whichever the scatter keeps), then checked against all
    tree_prompt = torch.empty(int(t.max()) + 1, dtype=prompt_L.dtype,
                              device=prompt_L.device).scatter_(0, t, prompt_L)
    if not torch.equal(tree_prompt[t], prompt_L):
        raise ValueError("a tree's leaves must all belong to one prompt")
    z_prompt = _group_z(reward_L, prompt_L, eps=eps, unbiased=True)  # (L,)
    if mode == "sum":
        return z_prompt + _group_z(reward_L, tree_L, eps=eps, unbiased=True)
    return _group_z(z_prompt, tree_L, eps=eps, unbiased=True)


def _structure(parent_N: torch.Tensor, tree_N: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depth, root and has-child flag of every node, after checking the forest is well formed.

    Shapes: parent_N (N,) int, tree_N (N,) or None -> depth_N, root_N (N,) long,
    has_child_N (N,) bool.
    """
    N = parent_N.numel()
    parent = parent_N.long()
    if parent_N.dim() != 1 or ((parent < -1) | (parent >= N)).any():
        raise ValueError("parent_N must be 1-D with entries in -1..N-1")
    # Walk every node up one level per step; a forest of depth D stops after D steps, and a
    # walk still going after N steps has met a cycle.
    root = torch.arange(N, device=parent.device)
    depth = torch.zeros(N, dtype=torch.long, device=parent.device)
    for _ in range(N + 1):
        up = parent[root]
        live = up >= 0
        if not live.any():
            break
        root = torch.where(live, up, root)
        depth += live.long()
    else:
        raise ValueError("parent_N contains a cycle")
    has_child = torch.zeros(N, dtype=torch.bool, device=parent.device)
    has_child[parent[parent >= 0]] = True
    is_root = parent < 0
    if (is_root & ~has_child).any():
        raise ValueError("every root needs at least one child (a trajectory of >= 1 turn)")
    if tree_N is not None:
        if not torch.equal(tree_N[root], tree_N):
            raise ValueError("tree_N must be constant along every root->leaf path")
        if torch.unique(tree_N[is_root]).numel() != int(is_root.sum()):
            raise ValueError("two roots share a tree label")
    return depth, root, has_child


def tree_leaves(parent_N: torch.Tensor) -> torch.Tensor:
    """Node numbers of the leaves (nodes without children), ascending: the order of every
    per-leaf (L) tensor and list in this module. Shapes: parent_N (N,) -> leaf_L (L,) long."""
    _, _, has_child = _structure(parent_N)
    return torch.nonzero(~has_child).flatten()


def at2po_node_values(*, parent_N: torch.Tensor, entropy_N: torch.Tensor,
                      leaf_reward_N: torch.Tensor, tree_N: torch.Tensor,
                      value_mode: ValueMode, leaf_norm: bool = True, eps: float = 1e-6
                      ) -> torch.Tensor:
    """AT2PO node values V_n, from the leaves up (arXiv 2601.04767 Eq. 3; algorithms.md §8.2).

    Leaves: V = r̂, with r̂ = (r − mean)/(std + eps) over the leaves of the same tree
    (population std) when `leaf_norm`, else r̂ = r. Internal nodes, by `value_mode`:
      child_weighted_linear  V_n = Σ_c w_c V_c, w_c = H(c)/Σ_c' H(c')   (paper Eq. 3; the plain
                             mean of the children when Σ H = 0)
      child_softmax          V_n = Σ_c w_c V_c, w_c = softmax_c H(c)    (released code)
      child_mean             V_n = mean_c V_c
      leaf_mean              V_n = mean of r̂ over all leaves below n
    c runs over n's children, H is the node's Monte-Carlo entropy (a root's is never used).

    Args:
      parent_N: parent of each node, −1 for roots.
      entropy_N: H(n); >= 0 for child_weighted_linear.
      leaf_reward_N: outcome reward r at leaves; other entries are ignored (NaN is fine).
      tree_N: tree label of each node (one root per label).
    Shapes: parent_N, entropy_N, leaf_reward_N, tree_N (N,) -> V_N (N,), dtype of
    leaf_reward_N.
    """
    if value_mode not in VALUE_MODES:
        raise ValueError(f"value_mode must be one of {VALUE_MODES}, got {value_mode!r}")
    depth, _, has_child = _structure(parent_N, tree_N)
    parent = parent_N.long()
    leaf = ~has_child
    r_L = leaf_reward_N[leaf]  # (L,)
    if not torch.isfinite(r_L).all():
        raise ValueError("every leaf needs a finite reward")
    if leaf_norm:
        r_L = _group_z(r_L, tree_N[leaf], eps=eps, unbiased=False)
    H = entropy_N.to(leaf_reward_N.dtype)
    if value_mode == "child_weighted_linear" and (H[parent >= 0] < 0).any():
        raise ValueError("child_weighted_linear needs non-negative entropies")

    zeros = torch.zeros_like(leaf_reward_N)
    value = zeros.masked_scatter(leaf, r_L)  # leaves final now; internal nodes filled below
    levels = range(int(depth.max()), 0, -1)
    # Deepest level first: when level d is pushed into its parents, every node at depth d
    # already has its final value (leaves from the start, internal nodes from level d + 1).
    if value_mode == "leaf_mean":
        # value accumulates the sum of r̂ below each node, count the number of those leaves
        count = leaf.to(value.dtype)
        for d in levels:
            c = torch.nonzero(depth == d).flatten()
            value = value.index_add(0, parent[c], value[c])
            count = count.index_add(0, parent[c], count[c])
        return value / count
    for d in levels:
        c = torch.nonzero(depth == d).flatten()  # children at this level
        p = parent[c]
        if value_mode == "child_mean":
            w = torch.ones_like(value[c])
        elif value_mode == "child_softmax":
            # Subtracting the siblings' max leaves exp(H)/Σ exp(H) unchanged and cannot
            # overflow.
            m = torch.full_like(value, -torch.inf).scatter_reduce(0, p, H[c], "amax")
            w = torch.exp(H[c] - m[p])
        else:
            h_sum = zeros.index_add(0, p, H[c])
            w = torch.where(h_sum[p] > 0, H[c], torch.ones_like(H[c]))
        num = zeros.index_add(0, p, w * value[c])
        den = zeros.index_add(0, p, w)  # > 0 exactly at the parents of level d
        value = torch.where(den > 0, num / den, value)
    return value


def at2po_node_advantages(*, V_N: torch.Tensor, parent_N: torch.Tensor, tree_N: torch.Tensor,
                          adv_mode: AdvMode) -> torch.Tensor:
    """AT2PO node advantages from node values (arXiv 2601.04767, Table 3 ablations;
    released code `node_adv_mode`; algorithms.md §8.2). For a non-root node n with parent p
    and tree root ρ:
      node_value        A_n = V_n                        (paper's default and best)
      diff_parent       A_n = V_n − V_p
      diff_global       A_n = V_n − V_ρ
      diff_localglobal  A_n = (V_n − V_ρ) + (V_n − V_p)
    A root gets A_ρ = V_ρ in every mode, as in the code; it has no tokens, so nothing uses it.

    Shapes: V_N, parent_N, tree_N (N,) -> A_N (N,).
    """
    if adv_mode not in ADV_MODES:
        raise ValueError(f"adv_mode must be one of {ADV_MODES}, got {adv_mode!r}")
    _, root, _ = _structure(parent_N, tree_N)
    parent = parent_N.long()
    is_root = parent < 0
    v_parent = V_N[parent.clamp(min=0)]  # (N,) meaningless at roots, replaced below
    v_root = V_N[root]  # (N,)
    if adv_mode == "node_value":
        adv = V_N
    elif adv_mode == "diff_parent":
        adv = V_N - v_parent
    elif adv_mode == "diff_global":
        adv = V_N - v_root
    else:
        adv = (V_N - v_root) + (V_N - v_parent)
    return torch.where(is_root, V_N, adv)


def leaf_turn_advantages(*, A_N: torch.Tensor, parent_N: torch.Tensor) -> list[torch.Tensor]:
    """Per-turn advantages of each trajectory: entry l lists A of the non-root nodes on the
    path root→leaf_l, in turn order (turn k = the node at depth k + 1), leaves ascending as
    `tree_leaves` gives them. AT2PO gives every token of turn k (its observation is masked
    out by the loss mask) the advantage of that node (algorithms.md §8.2, token assignment).

    Shapes: A_N, parent_N (N,) -> list of L tensors, entry l of shape (depth of leaf l,).
    """
    depth, _, has_child = _structure(parent_N)
    parent = parent_N.long()
    leaf = torch.nonzero(~has_child).flatten()  # (L,)
    # Column j holds each leaf's j-th ancestor (column 0: the leaf itself), so the leaf's
    # turns, last to first, are its first depth-many columns.
    chain = [leaf]
    for _ in range(int(depth[leaf].max()) - 1):
        up = chain[-1]
        chain.append(torch.where(up >= 0, parent[up.clamp(min=0)], up))
    anc_LD = torch.stack(chain, dim=1)  # (L, max depth)
    return [A_N[anc_LD[i, : int(depth[n])].flip(0)] for i, n in enumerate(leaf.tolist())]
