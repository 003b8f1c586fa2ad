"""`turn_advantages`: the framework-agnostic entry point (DESIGN.md §4).

Any trainer (ours, verl, TRL) can call it with plain Python data: one dict per trajectory with
  "group": hashable    the prompt the trajectory answers (its GRPO group),
  "reward": float      the outcome reward,
  "info_gain": [float | None, ...]   one value per tool-call turn (IGPO family; None = absent),
  "num_turns": int     turns including the final one (default: len(info_gain) + 1),
  "anchors": [str, ...]            per turn, the anchor observation (GiGPO),
  "tree": hashable, "nodes": [id, ...], "entropies": [float, ...]   (tree methods: the leaf's
      path of node ids from the root, and each node's entropy, aligned with "nodes").
It returns, per trajectory, the advantage of each turn (tool-call turns, then the final turn)
and, for methods with adaptive clipping, each turn's clip scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from a2tgpo.algo import advantages as adv_fns
from a2tgpo.algo.methods import AdvantageConfig, MethodConfig, get_method


@dataclass(frozen=True)
class TurnAdvantages:
    advantages: list[float]
    clip_scales: list[float] | None = None


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
    """Per-turn advantages (and clip scales) of `trajectories` under `method`.

    `hparams` override the method's advantage settings (AdvantageConfig fields), e.g.
    `turn_advantages("a2tgpo", trajs, beta=0.5)`.
    """
    cfg = get_method(method) if isinstance(method, str) else method
    a: AdvantageConfig = replace(cfg.advantage, **hparams)
    if not trajectories:
        return []
    dt = torch.float64
    T = torch.tensor([_num_turns(t) for t in trajectories])
    reward = torch.tensor([float(t["reward"]) for t in trajectories], dtype=dt)
    groups = [t["group"] for t in trajectories]
    per_traj = lambda x: [TurnAdvantages([float(x[b])] * int(T[b]))  # noqa: E731
                          for b in range(len(trajectories))]

    if a.estimator == "none":
        return [TurnAdvantages([0.0] * int(n)) for n in T]
    if a.estimator == "grpo":
        return per_traj(adv_fns.grpo_advantages(reward_B=reward, group_B=groups,
                                                norm_std=a.norm_std, eps=a.eps))
    if a.estimator == "igpo_family":
        K = int(T.max())
        ig = torch.zeros(len(trajectories), K, dtype=dt)
        mask = torch.zeros(len(trajectories), K, dtype=torch.bool)
        for b, t in enumerate(trajectories):
            for k, v in enumerate(t.get("info_gain", [])):
                if v is not None and math.isfinite(v):
                    ig[b, k], mask[b, k] = v, True
        adv, clip, _ = adv_fns.igpo_family_advantages(
            ig_BK=ig, ig_mask_BK=mask, num_turns_B=T, outcome_B=reward, group_B=groups,
            ig_norm=a.ig_norm, outcome_mode=a.outcome_mode, gamma=a.gamma,
            sqrt_rescale=a.sqrt_rescale, process_weight=a.process_weight, beta=a.beta, eps=a.eps)
        adaptive = cfg.loss.adaptive_clip and a.beta > 0
        return [TurnAdvantages(adv[b, :n].tolist(), clip[b, :n].tolist() if adaptive else None)
                for b, n in enumerate(T.tolist())]
    if a.estimator == "gigpo":
        adv = adv_fns.gigpo_advantages(
            episode_reward_B=reward, group_B=groups, num_turns_B=T,
            anchors=[t["anchors"] for t in trajectories], gamma=a.gamma, omega=a.omega,
            mode=a.gigpo_mode, similarity_threshold=a.similarity_threshold, eps=a.eps)
        return [TurnAdvantages(adv[b, :n].tolist()) for b, n in enumerate(T.tolist())]
    if a.estimator in ("tree_grpo", "at2po"):
        return _tree_turn_advantages(a, trajectories, reward, groups)
    raise ValueError(f"unknown estimator {a.estimator!r}")


def _tree_turn_advantages(a: AdvantageConfig, trajectories, reward, groups
                          ) -> list[TurnAdvantages]:
    """Rebuild the forest from the leaves' root->leaf paths, then per-turn advantages."""
    from a2tgpo.algo import tree as tree_fns

    if a.estimator == "tree_grpo":
        tree_L, _ = adv_fns.group_index([(g, t["tree"]) for g, t in zip(groups, trajectories)])
        prompt_L, _ = adv_fns.group_index(groups)
        adv = tree_fns.tree_grpo_advantages(reward_L=reward, tree_L=tree_L, prompt_L=prompt_L,
                                            eps=a.eps, mode=a.tree_mode)
        return [TurnAdvantages([float(adv[b])] * _num_turns(t))
                for b, t in enumerate(trajectories)]
    index: dict[tuple, int] = {}
    parent: list[int] = []
    entropy: list[float] = []
    tree_of: list[int] = []
    trees: dict[tuple, int] = {}
    leaf_node: list[int] = []
    for t, g in zip(trajectories, groups):
        key_tree = (g, t["tree"])
        tid = trees.setdefault(key_tree, len(trees))
        if len(t["nodes"]) != len(t["entropies"]):
            raise ValueError("each tree trajectory needs one entropy per node of its path")
        prev = -1
        for node, h in zip(t["nodes"], t["entropies"]):
            key = (key_tree, node)
            if key not in index:
                index[key] = len(parent)
                parent.append(prev)
                entropy.append(float(h))
                tree_of.append(tid)
            elif parent[index[key]] != prev:
                raise ValueError(f"node {node!r} of tree {t['tree']!r} has two parents")
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
    path_adv = {}
    for leaf, turns in zip(tree_fns.tree_leaves(parent_N).tolist(),
                           tree_fns.leaf_turn_advantages(A_N=A, parent_N=parent_N)):
        path_adv[leaf] = [float(x) for x in turns]
    return [TurnAdvantages(path_adv[leaf]) for leaf in leaf_node]
