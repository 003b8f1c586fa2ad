"""Tree-shaped rollouts: Tree-GRPO (random expansion), AT2PO (entropy-guided expansion) and
AEPO (entropy-triggered branching of chains); algorithms.md §7.1, §7.2, §8.1.

A node is one turn: its sampled action plus the observation that followed it. The root is the
prompt (entropy 0, id 0). Node ids are ints, unique within a tree and given in creation order;
`TrajectoryBuilder.node_ids[k]` is the node of a builder's turn k. A branch is only ever made
with `TrajectoryBuilder.branch(k)`, so every trajectory through a node holds the very same turn
objects (same token ids) for the shared prefix: nothing is regenerated or re-tokenised.

A node's entropy is `Turn.entropy`, the mean −log π of its sampled tokens: AT2PO's node entropy
(`node.entropy = −mean(logprob)`; paper Eq. 2 as a Monte-Carlo estimate).

Tree-GRPO and AT2PO run by the rollout's schedule (`agent.continue_rollouts`): a phase (the
first chains, then each expansion round) runs every live builder to the end of its episode, in
waves or each trajectory on its own. A round's expansions are chosen from the whole tree the
phase before left (AT2PO scores every node; Tree-GRPO draws from every non-leaf node), so a
branch starts once its round is chosen, after every builder of the phase before has ended;
within a phase nothing waits for another trajectory's turn. New turns get node ids in wave
order whatever the schedule (`RolloutTree.register`), so node ids, AT2PO's ties to the older
node and the expansion draws are the same under both schedules. AEPO decides its branches
after each wave from that wave's entropies and counts consecutive branching waves, so it runs
in waves (`agent.rollout_wave`) under either schedule.
Builders live in one list for the whole call and never move, so the per-(builder, turn) seeds
are distinct and the result is a function of `seed` alone; `rng` (default
`random.Random(seed)`) makes every choice (expansion nodes, leaves, branch draws).

Each tree builder is one leaf: it ends at a node no other builder holds, because every branch
generates at least one new turn. A tree's leaves are therefore its builders, one trajectory
per leaf, with `Trajectory.tree` = the leaf's root-first path and the entropies along it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from a2tgpo.algo.methods import RolloutShapeConfig
from a2tgpo.algo.types import TreePath
from a2tgpo.rollout.agent import (
    AgentConfig,
    Question,
    SearchTool,
    continue_rollouts,
    is_live,
    prompt_ids,
    rollout_wave,
)
from a2tgpo.rollout.engine import Engine
from a2tgpo.rollout.trajectory import Trajectory, TrajectoryBuilder, Turn

ROOT = 0
AEPO_ENTROPY_TOKENS = 20  # AEPO reads the entropy of a step's first <= 20 tokens
AEPO_BRANCH_DECAY = 0.05  # AEPO: p *= 1 − 0.05·consecutive_branches


@dataclass
class RolloutNode:
    """One node of a `RolloutTree`: a turn, or the root (the prompt)."""

    parent: int  # −1 for the root
    turn: int  # the node's turn index on its path; −1 for the root
    entropy: float
    home: TrajectoryBuilder | None  # a builder whose path holds the node (None: root, copies)
    children: int = 0


class RolloutTree:
    """One tree of one question: its nodes (id = index, root 0) and its builders (leaves)."""

    def __init__(self, tree_id: str):
        self.id = tree_id
        self.nodes = [RolloutNode(-1, -1, 0.0, None)]
        self.builders: list[TrajectoryBuilder] = []
        self.extra: list[dict] = []  # how each builder came about, for Trajectory.extra

    def add(self, b: TrajectoryBuilder, **extra) -> TrajectoryBuilder:
        self.builders.append(b)
        self.extra.append(extra)
        return b

    def register(self) -> None:
        """Give each turn added since the last call a fresh node id, in wave order: every
        builder's first new turn (builder order), then every second new turn, and so on, as
        one call after each wave would number them."""
        start = [len(b.node_ids) for b in self.builders]
        for step in range(max((len(b.turns) - s for b, s in zip(self.builders, start,
                                                                   strict=True)), default=0)):
            for b, s in zip(self.builders, start, strict=True):
                k = s + step
                if k >= len(b.turns):
                    continue
                parent = b.node_ids[k - 1] if k else ROOT
                self.nodes[parent].children += 1
                self.nodes.append(RolloutNode(parent, k, float(b.turns[k].entropy), b))
                b.node_ids.append(len(self.nodes) - 1)

    def expandable(self) -> list[int]:
        """The root and every node with a child, by id. A turn that called the tool but has no
        child (the length budget ran out after its observation) cannot be continued."""
        return [i for i, n in enumerate(self.nodes) if i == ROOT or n.children]

    def branch(self, node: int, *, sibling: bool) -> TrajectoryBuilder:
        """A new builder that continues after `node` (Tree-GRPO) or regenerates `node`'s turn
        from its parent's state (AT2PO, sibling=True); either way a fresh chain at the root."""
        n = self.nodes[node]
        k = max(n.turn, 0) if sibling else n.turn + 1
        return (n.home or self.builders[0]).branch(k)

    def position(self, b: TrajectoryBuilder) -> TreePath:
        return TreePath(self.id, (ROOT, *b.node_ids),
                            (0.0, *(self.nodes[i].entropy for i in b.node_ids)))

    def duplicate(self, b: TrajectoryBuilder) -> TreePath:
        """A new leaf node copying b's leaf (same parent, turn, entropy): the path of a
        duplicated leaf, which credit assignment must see as a leaf of its own."""
        leaf = self.nodes[b.node_ids[-1]]
        self.nodes[leaf.parent].children += 1
        self.nodes.append(RolloutNode(leaf.parent, leaf.turn, leaf.entropy, None))
        pos = self.position(b)
        return TreePath(pos.tree, (*pos.nodes[:-1], len(self.nodes) - 1), pos.entropies)


def _question_builders(questions: Sequence[Question], tool: SearchTool, cfg: AgentConfig,
                       chat_kwargs: dict | None) -> list[Callable[[], TrajectoryBuilder]]:
    """Per question, a factory of empty builders that share one prompt tuple."""
    out = []
    for q in questions:
        ids = tuple(prompt_ids(tool.tokenizer, q.question, cfg.prompt_style, chat_kwargs))
        out.append(lambda q=q, ids=ids: TrajectoryBuilder(
            ids, question_id=q.id, group_id=q.id, golden_answers=q.golden_answers))
    return out


def _run_phase(builders: list[TrajectoryBuilder], trees: list[RolloutTree], engine: Engine,
               tool: SearchTool, cfg: AgentConfig, seed: int) -> None:
    """Run every live builder to the end of its episode (by `cfg.schedule`), then number the
    new nodes. `builders` holds every builder of the call (finished ones are not live), so a
    builder's index, hence its sampling seeds, never changes."""
    continue_rollouts(builders, engine, tool, cfg, seed=seed)
    for t in trees:
        t.register()


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# --------------------------------------------------------------------------------------------
# Tree-GRPO


def rollout_tree_grpo(questions: Sequence[Question], engine: Engine, tool: SearchTool,
                      agent_cfg: AgentConfig, shape_cfg: RolloutShapeConfig, *, seed: int,
                      rng: random.Random | None = None, chat_kwargs: dict | None = None
                      ) -> list[Trajectory]:
    """Tree-GRPO (algorithms.md §7.1): M trees per question, each rooted in one full chain;
    L iterations, each sampling N nodes per tree uniformly with replacement from the root and
    the non-leaf nodes and continuing each from its state (after its turn) to completion; then
    K leaves per tree, without replacement.

    Each expansion adds exactly one leaf, so a tree has 1 + L·N leaves; K > 1 + L·N is
    rejected up front (the reference code asserts it), so leaves are never duplicated here.
    Returns M·K trajectories per question (group id = question id), question by question, tree
    by tree, leaves in creation order; `extra["expansion"] = (iteration, node)` on the leaves
    an expansion made.
    """
    m, n_exp, iters, k = shape_cfg.tree_m, shape_cfg.tree_n, shape_cfg.tree_l, shape_cfg.tree_k
    # the shape's arithmetic (n = M·K, K <= 1 + L·N) is checked by RolloutShapeConfig
    rng = rng or random.Random(seed)
    trees: list[RolloutTree] = []
    builders: list[TrajectoryBuilder] = []
    for q, make in zip(questions, _question_builders(questions, tool, agent_cfg, chat_kwargs),
                       strict=True):
        for j in range(m):
            trees.append(RolloutTree(f"{q.id}#{j}"))
            builders.append(trees[-1].add(make()))
    _run_phase(builders, trees, engine, tool, agent_cfg, seed)
    for it in range(iters):
        for t in trees:
            for node in rng.choices(t.expandable(), k=n_exp):
                builders.append(t.add(t.branch(node, sibling=False), expansion=(it, node)))
        _run_phase(builders, trees, engine, tool, agent_cfg, seed)
    out = []
    for t in trees:
        for i in sorted(rng.sample(range(len(t.builders)), k)):
            out.append(t.builders[i].build(tree=t.position(t.builders[i]), extra=dict(t.extra[i])))
    return out


# --------------------------------------------------------------------------------------------
# AT2PO


def at2po_scores(tree: RolloutTree, alpha: float) -> list[tuple[int, float]]:
    """(node, s(node)) for the expandable nodes, by id: s = H(n) − α·(|children(parent)| − 1),
    and the root (H 0) counts its own children. The −1 is the code's (algorithms.md §8.1); the
    paper's −α·|children(parent)| ranks non-root nodes the same and only moves the root."""
    out = []
    for i in tree.expandable():
        n = tree.nodes[i]
        siblings = n.children if i == ROOT else tree.nodes[n.parent].children
        out.append((i, n.entropy - alpha * max(0, siblings - 1)))
    return out


def at2po_select(scores: Sequence[tuple[int, float]], k: int, mode: str,
                 rng: random.Random) -> list[int]:
    """K nodes to expand. entropy: the top K by score, ties to the older (smaller id) node;
    with fewer candidates than K the ranking repeats from the top, as the code duplicates its
    top nodes. random: K distinct nodes at random, or K draws with replacement when fewer."""
    nodes = [i for i, _ in scores]
    if mode == "random":
        return rng.sample(nodes, k) if len(nodes) >= k else rng.choices(nodes, k=k)
    ranked = [i for i, _ in sorted(scores, key=lambda x: (-x[1], x[0]))]
    return [ranked[j % len(ranked)] for j in range(k)]


def rollout_at2po(questions: Sequence[Question], engine: Engine, tool: SearchTool,
                  agent_cfg: AgentConfig, shape_cfg: RolloutShapeConfig, *, seed: int,
                  rng: random.Random | None = None, chat_kwargs: dict | None = None
                  ) -> list[Trajectory]:
    """AT2PO entropy-guided tree expansion (algorithms.md §8.1): one tree per question with M
    chains from the root; L rounds, each scoring the root and the non-leaf nodes, picking K
    (`at2po_select`) and expanding each by a sibling that regenerates the node's turn from its
    parent's state (the root's "sibling" is a fresh chain); scores are computed once per round.
    Each expansion adds one leaf: M + L·K leaves (22 at M=10, L=2, K=6).

    The tree then has exactly `shape_cfg.n` leaves, as the code's `sample_leaves`: with more,
    n sampled without replacement (unsampled branches are dropped); with fewer, the last leaf
    is copied as new leaf nodes under the same parent (same turns and entropy, distinct ids;
    `extra["duplicate_of"]` = the copied leaf's node). Expansion leaves carry
    `extra["expansion"] = (round, expanded node)`.
    """
    m, rounds, k, alpha = (shape_cfg.tree_m, shape_cfg.tree_l, shape_cfg.tree_k,
                           shape_cfg.expansion_penalty)
    rng = rng or random.Random(seed)
    trees: list[RolloutTree] = []
    builders: list[TrajectoryBuilder] = []
    for q, make in zip(questions, _question_builders(questions, tool, agent_cfg, chat_kwargs),
                       strict=True):
        trees.append(RolloutTree(f"{q.id}#0"))
        builders += [trees[-1].add(make()) for _ in range(m)]
    _run_phase(builders, trees, engine, tool, agent_cfg, seed)
    for r in range(rounds):
        for t in trees:
            for node in at2po_select(at2po_scores(t, alpha), k, shape_cfg.node_select, rng):
                builders.append(t.add(t.branch(node, sibling=True), expansion=(r, node)))
        _run_phase(builders, trees, engine, tool, agent_cfg, seed)
    out = []
    for t in trees:
        n_leaves = len(t.builders)
        keep = (sorted(rng.sample(range(n_leaves), shape_cfg.n)) if n_leaves > shape_cfg.n
                else range(n_leaves))
        for i in keep:
            out.append(t.builders[i].build(tree=t.position(t.builders[i]), extra=dict(t.extra[i])))
        last = t.builders[-1]
        for _ in range(shape_cfg.n - n_leaves):
            out.append(last.build(tree=t.duplicate(last),
                                  extra={**t.extra[-1], "duplicate_of": last.node_ids[-1]}))
    return out


# --------------------------------------------------------------------------------------------
# AEPO


def aepo_entropy(turn: Turn) -> float:
    """AEPO's step entropy, from what a turn keeps: the mean −log π of its first 20 sampled
    tokens, a Monte-Carlo estimate of their mean entropy. The code sums −p·log p over the
    top-10 candidates of each of those tokens and divides by log|V|; `Turn` keeps neither the
    candidates nor per-token entropies. The scales differ (≈ 20/log|V| ≈ 1.7× ours for Qwen
    at 20+ tokens), so w·(H_now − H_init) weighs entropy somewhat less here."""
    lps = turn.action_logprobs[:AEPO_ENTROPY_TOKENS]
    return -sum(lps) / len(lps)


def rollout_aepo(questions: Sequence[Question], engine: Engine, tool: SearchTool,
                 agent_cfg: AgentConfig, shape_cfg: RolloutShapeConfig, *, seed: int,
                 rng: random.Random | None = None, chat_kwargs: dict | None = None
                 ) -> list[Trajectory]:
    """AEPO rollout (algorithms.md §7.2): `aepo_initial` chains per question (clamped to
    [1, n], as the code); after each wave, each chain still going tries one branch,
    p = U(0,1) + w·(H_now − H_init), times (1 − 0.05·c), clamped to [0, 1], where c counts the
    question's consecutive waves that added chains (reset by a wave that adds none; the code
    skips the reset in waves where no question adds one); it branches (a copy that continues
    independently from the same state) when p >= `aepo_branch_probability` and the question
    has fewer than n chains. H_init is the chain's first own step (for a copy: its first step
    after the copy). A question with no chain going and fewer than n gets one fresh chain per
    wave. Exactly n chains per question, in creation order, group id = question id;
    `extra["aepo_parent"]` = index (within the question) of the chain it copies, or None,
    `extra["aepo_shared_turns"]` = turns it shares with it.
    """
    n, w, threshold = (shape_cfg.n, shape_cfg.aepo_entropy_weight,
                       shape_cfg.aepo_branch_probability)
    _check(n >= 1, f"AEPO needs n >= 1 (n={n})")
    rng = rng or random.Random(seed)
    makers = _question_builders(questions, tool, agent_cfg, chat_kwargs)
    builders: list[TrajectoryBuilder] = []
    extra: list[dict] = []
    h_init: list[float | None] = []
    per_q: list[list[int]] = [[] for _ in questions]  # builder indices of each question
    live: list[bool] = []

    def add(q: int, b: TrajectoryBuilder, parent: int | None) -> None:
        per_q[q].append(len(builders))
        extra.append({"aepo_parent": None if parent is None else per_q[q].index(parent),
                      "aepo_shared_turns": len(b.turns)})
        builders.append(b)
        h_init.append(None)
        live.append(is_live(b, agent_cfg))

    for q, make in enumerate(makers):
        for _ in range(max(1, min(shape_cfg.aepo_initial, n))):
            add(q, make(), None)
    consecutive = [0] * len(questions)
    while any(live) or any(len(idx) < n for idx in per_q):
        stepped = [i for i, lv in enumerate(live) if lv]
        live[:] = rollout_wave(builders, live, engine, tool, agent_cfg, seed=seed)
        h_now = {i: aepo_entropy(builders[i].turns[-1]) for i in stepped}
        for i in stepped:
            if h_init[i] is None:
                h_init[i] = h_now[i]
        for q, idx in enumerate(per_q):
            before = len(idx)
            going = [i for i in idx if live[i]]
            for i in going:
                if len(idx) >= n:
                    break
                p = rng.random() + w * (h_now[i] - h_init[i])
                p = min(1.0, max(0.0, p * max(0.0, 1 - AEPO_BRANCH_DECAY * consecutive[q])))
                if p >= threshold:
                    add(q, builders[i].branch(len(builders[i].turns)), i)
            if not going and len(idx) < n:
                add(q, makers[q](), None)
            consecutive[q] = consecutive[q] + 1 if len(idx) > before else 0
    return [builders[i].build(extra=extra[i]) for idx in per_q for i in idx]
