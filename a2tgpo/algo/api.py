"""The advantage entry points: `turn_advantage_tensors` (tensors; our trainer) and
`turn_advantages` (plain Python data; any trainer: verl, TRL; DESIGN.md §4).

Both give, per trajectory, the advantage of each turn (tool-call turns, then the final turn)
and, for methods with adaptive clipping (`loss.adaptive_clip`), each turn's clip scale.
`turn_advantages` is a thin wrapper: it builds a `TurnInputs` from one dict per trajectory,
  "group": hashable    the prompt the trajectory answers (its GRPO group),
  "reward": float      the outcome reward,
  "info_gain": [float | None, ...]   one value per process turn (IGPO family; None = absent),
  "num_turns": int     turns including the final one (default: len(info_gain) + 1),
  "anchors": [str, ...]            per turn, the anchor observation (GiGPO),
  "tree": hashable, "nodes": [id, ...], "entropies": [float, ...]   (tree methods: the leaf's
      path of node ids from the root, and each node's entropy, aligned with "nodes"),
and returns `TurnAdvantages` lists.

Shape legend: B trajectories, K turn slots (the most turns of any trajectory).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

import torch

from a2tgpo.algo import advantages as adv_fns
from a2tgpo.algo import tree as tree_fns
from a2tgpo.algo.methods import AdvantageConfig, MethodConfig, get_method
from a2tgpo.algo.types import TreePath


@dataclass(frozen=True)
class TurnInputs:
    """What the estimators read, one row per trajectory.

    reward_B (B,) float: outcome rewards; group_B: B prompt labels; num_turns_B (B,) long:
    turns including the final one; ig_BK, ig_mask_BK (B, K): the IG of process turn k and
    whether it exists (IGPO family; `info_gain.ig_by_turn` places it); anchors: per trajectory
    and turn, the anchor observation (GiGPO); trees: per trajectory, its `TreePath` (tree
    methods).
    """

    reward_B: torch.Tensor
    group_B: Sequence[Hashable]
    num_turns_B: torch.Tensor
    ig_BK: torch.Tensor | None = None
    ig_mask_BK: torch.Tensor | None = None
    anchors: Sequence[Sequence[str]] | None = None
    trees: Sequence[TreePath] | None = None


@dataclass(frozen=True)
class TurnAdvantages:
    advantages: list[float]
    clip_scales: list[float] | None = None


def turn_advantage_tensors(method: str | MethodConfig, inputs: TurnInputs, **hparams
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-turn advantages and clip scales of a batch under `method`, in float64.

    `hparams` override the method's advantage settings (AdvantageConfig fields).
    Returns adv_BK (0 at k >= T_b) and clip_BK (1 where a turn has no IG, at k >= T_b too),
    or None for clip_BK when the method does not clip adaptively.

    Shapes: see `TurnInputs`; K = max(num_turns_B).
    """
    cfg = get_method(method) if isinstance(method, str) else method
    a: AdvantageConfig = replace(cfg.advantage, **hparams)
    dt = torch.float64
    reward = inputs.reward_B.to(dt)
    T = inputs.num_turns_B.long()
    B = len(T)
    K = int(T.max()) if B else 0
    groups = inputs.group_B
    clip = None
    if a.estimator == "none":
        adv = torch.zeros(B, K, dtype=dt)
    elif a.estimator == "grpo":
        adv = _broadcast(adv_fns.grpo_advantages(reward_B=reward, group_B=groups,
                                                 norm_std=a.norm_std, eps=a.eps), T, K)
    elif a.estimator == "igpo_family":
        if inputs.ig_BK is None or inputs.ig_mask_BK is None:
            raise ValueError(f"method {cfg.id}: the igpo_family estimator needs ig_BK and "
                             "ig_mask_BK")
        adv, clip, _ = adv_fns.igpo_family_advantages(
            ig_BK=inputs.ig_BK[:, :K].to(dt), ig_mask_BK=inputs.ig_mask_BK[:, :K],
            num_turns_B=T, outcome_B=reward, group_B=groups, ig_norm=a.ig_norm,
            outcome_mode=a.outcome_mode, gamma=a.gamma, sqrt_rescale=a.sqrt_rescale,
            process_weight=a.process_weight, beta=a.beta, eps=a.eps)
    elif a.estimator == "gigpo":
        if inputs.anchors is None:
            raise ValueError(f"method {cfg.id}: the gigpo estimator needs anchors")
        adv = adv_fns.gigpo_advantages(
            episode_reward_B=reward, group_B=groups, num_turns_B=T,
            anchors=inputs.anchors, gamma=a.gamma, omega=a.omega, mode=a.gigpo_mode,
            similarity_threshold=a.similarity_threshold, eps=a.eps)
    elif a.estimator in ("tree_grpo", "at2po"):
        if inputs.trees is None:
            raise ValueError(f"method {cfg.id}: the {a.estimator} estimator needs trees")
        bad = [b for b, p in enumerate(inputs.trees) if len(p.nodes) - 1 != int(T[b])]
        if bad:
            raise ValueError(f"trajectory {bad[0]}: a tree path of "
                             f"{len(inputs.trees[bad[0]].nodes)}"
                             f" nodes is not one node per turn plus the root "
                             f"({int(T[bad[0]])} turns)")
        adv = _tree_advantages(a, inputs.trees, reward, groups, T, K)
    else:
        raise ValueError(f"unknown estimator {a.estimator!r}")
    # MethodConfig allows adaptive_clip with the igpo_family estimator only
    return adv, clip if cfg.loss.adaptive_clip else None


def _broadcast(x_B: torch.Tensor, T: torch.Tensor, K: int) -> torch.Tensor:
    """One value per trajectory on each of its turns: (B,) -> (B, K), 0 at k >= T_b."""
    exists = torch.arange(K)[None, :] < T[:, None]
    return torch.where(exists, x_B[:, None].expand(-1, K), torch.zeros((), dtype=x_B.dtype))


def _tree_advantages(a: AdvantageConfig, paths: Sequence[TreePath], reward, groups, T, K
                     ) -> torch.Tensor:
    """Rebuild the forest from the leaves' root->leaf paths, then per-turn advantages."""
    if a.estimator == "tree_grpo":
        tree_L, _ = adv_fns.group_index([(g, p.tree) for g, p in zip(groups, paths, strict=True)])
        prompt_L, _ = adv_fns.group_index(groups)
        return _broadcast(tree_fns.tree_grpo_advantages(
            reward_L=reward, tree_L=tree_L, prompt_L=prompt_L, eps=a.eps, mode=a.tree_mode),
            T, K)
    index: dict[tuple, int] = {}
    parent: list[int] = []
    entropy: list[float] = []
    tree_of: list[int] = []
    trees: dict[tuple, int] = {}
    leaf_node: list[int] = []
    for p, g in zip(paths, groups, strict=True):
        key_tree = (g, p.tree)
        tid = trees.setdefault(key_tree, len(trees))
        if len(p.nodes) != len(p.entropies):
            raise ValueError("each tree trajectory needs one entropy per node of its path")
        prev = -1
        for node, h in zip(p.nodes, p.entropies, strict=True):
            key = (key_tree, node)
            if key not in index:
                index[key] = len(parent)
                parent.append(prev)
                entropy.append(float(h))
                tree_of.append(tid)
            elif parent[index[key]] != prev:
                raise ValueError(f"node {node!r} of tree {p.tree!r} has two parents")
            prev = index[key]
        leaf_node.append(prev)
    if len(set(leaf_node)) != len(leaf_node):
        raise ValueError("two trajectories end at the same leaf; list duplicated leaves as "
                         "separate nodes (AT2PO duplicates leaves upstream)")
    dt = reward.dtype
    leaf_reward = torch.full((len(parent),), float("nan"), dtype=dt)
    leaf_reward[torch.tensor(leaf_node)] = reward
    parent_N = torch.tensor(parent)
    tree_N = torch.tensor(tree_of)
    V = tree_fns.at2po_node_values(parent_N=parent_N, entropy_N=torch.tensor(entropy, dtype=dt),
                                   leaf_reward_N=leaf_reward, tree_N=tree_N,
                                   value_mode=a.value_mode, leaf_norm=a.leaf_norm, eps=a.eps)
    A = tree_fns.at2po_node_advantages(V_N=V, parent_N=parent_N, tree_N=tree_N,
                                       adv_mode=a.adv_mode)
    path_adv = dict(zip(tree_fns.tree_leaves(parent_N).tolist(),
                        tree_fns.leaf_turn_advantages(A_N=A, parent_N=parent_N), strict=True))
    adv = torch.zeros(len(paths), K, dtype=dt)
    for b, leaf in enumerate(leaf_node):
        turns = path_adv[leaf]
        adv[b, : len(turns)] = turns
    return adv


# --------------------------------------------------------------------------------------------
# plain-data wrapper


def _num_turns(t: dict) -> int:
    if "nodes" in t:  # a tree leaf: every node below the root is one turn
        return len(t["nodes"]) - 1
    if "num_turns" in t:
        return int(t["num_turns"])
    if "info_gain" in t:
        return len(t["info_gain"]) + 1
    return 1


def turn_advantages(method: str | MethodConfig, trajectories: list[dict], **hparams
                    ) -> list[TurnAdvantages]:
    """Per-turn advantages (and clip scales) of `trajectories` under `method` (the dicts of
    the module docstring), by `turn_advantage_tensors`.

    `hparams` override the method's advantage settings (AdvantageConfig fields), e.g.
    `turn_advantages("a2tgpo", trajs, beta=0.5)`.
    """
    if not trajectories:
        return []
    T = torch.tensor([_num_turns(t) for t in trajectories])
    B, K = len(trajectories), int(T.max())
    ig = torch.zeros(B, K, dtype=torch.float64)
    mask = torch.zeros(B, K, dtype=torch.bool)
    for b, t in enumerate(trajectories):
        for k, v in enumerate(t.get("info_gain", [])[:K]):
            if v is not None and math.isfinite(v):
                ig[b, k], mask[b, k] = v, True
    has = lambda key: all(key in t for t in trajectories)  # noqa: E731
    inputs = TurnInputs(
        reward_B=torch.tensor([float(t["reward"]) for t in trajectories], dtype=torch.float64),
        group_B=[t["group"] for t in trajectories], num_turns_B=T, ig_BK=ig, ig_mask_BK=mask,
        anchors=[t["anchors"] for t in trajectories] if has("anchors") else None,
        trees=[TreePath(t["tree"], t["nodes"], t["entropies"]) for t in trajectories]
        if has("nodes") else None)
    adv, clip = turn_advantage_tensors(method, inputs, **hparams)
    return [TurnAdvantages(adv[b, :n].tolist(), None if clip is None else clip[b, :n].tolist())
            for b, n in enumerate(T.tolist())]
