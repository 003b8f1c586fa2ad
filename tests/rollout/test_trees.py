"""Tree rollouts (Tree-GRPO, AT2PO, AEPO) with a scripted engine and a fixed retriever: shapes,
path consistency, shared prefix ids, AT2PO's expansion choice, AEPO's branching, determinism,
and the hand-off to `turn_advantages`."""

import dataclasses
import random
import re
from collections import defaultdict

import pytest
from conftest import FixedRetriever

from a2tgpo.algo import turn_advantages
from a2tgpo.algo.methods import RolloutShapeConfig
from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.rollout.agent import AgentConfig, Question, SearchTool
from a2tgpo.rollout.trees import at2po_select, rollout_aepo, rollout_at2po, rollout_tree_grpo

CFG = AgentConfig(max_turn_tokens=64, max_response_tokens=900, max_obs_tokens=60)
SEARCH = RetrievalConfig()  # passages per search and their length
QS = [Question("q1", "Who directed Foo", ("a1",)), Question("q2", "Where is Baz", ("a2",))]
AT2PO = RolloutShapeConfig(shape="tree_entropy", n=22, tree_m=10, tree_l=2, tree_k=6)
TREE_GRPO = RolloutShapeConfig(shape="tree_random", n=6, tree_m=2, tree_n=2, tree_l=1, tree_k=3)
AEPO = RolloutShapeConfig(shape="aepo", n=16, aepo_initial=8)


def varied(user, turn, seed):
    """Queries and answers vary by seed; some chains answer at once, some after one search,
    the rest after two, so leaves sit at different depths."""
    if turn >= 2 or seed % 5 == turn:
        return f"<think> done </think> <answer> \\boxed{{a{seed % 3}}} </answer>"
    subject = user.split()[-1].rstrip("?")
    return f"<think> step {turn} </think> <search> {subject} q{seed % 4} </search>"


class EntropyEngine:
    """Wraps an engine; each sampled token's logprob becomes −x/10, where the action contains
    "h<x>" (a scripted node entropy of x/10)."""

    def __init__(self, inner, tokenizer):
        self.inner, self.tok = inner, tokenizer
        self.calls = inner.calls

    def generate(self, prompts, params, seeds=None):
        out = []
        for g in self.inner.generate(prompts, params, seeds):
            h = int(re.search(r"h(\d+)", self.tok.decode(g.token_ids)).group(1)) / 10
            out.append(dataclasses.replace(g, logprobs=(-h,) * len(g.token_ids)))
        return out


def setup(scripted, tok, script, entropy=False):
    engine, retriever = scripted(script), FixedRetriever()
    if entropy:
        engine = EntropyEngine(engine, tok)
    return engine, retriever, SearchTool(retriever, tok, CFG, SEARCH)


def check_forest(trajs):
    """Every leaf's path is root-first, one node per turn; a node id names one node of its
    tree (one parent, one turn object, one entropy); paths through a node share the exact
    prefix ids; no two trajectories end at the same leaf."""
    seen = {}  # (tree, node) -> (parent, turn, entropy, trajectory)
    leaves = set()
    for t in trajs:
        p = t.tree
        assert len(p.nodes) == len(t.turns) + 1 == len(p.entropies)
        assert p.nodes[0] == 0 and p.entropies[0] == 0.0
        assert len(set(p.nodes)) == len(p.nodes)
        for j, node in enumerate(p.nodes[1:], start=1):
            turn = t.turns[j - 1]
            assert p.entropies[j] == pytest.approx(-sum(turn.action_logprobs)
                                                   / len(turn.action_logprobs))
            key = (p.tree, node)
            if key not in seen:
                seen[key] = (p.nodes[j - 1], turn, p.entropies[j], t)
                continue
            parent, other_turn, h, other = seen[key]
            assert parent == p.nodes[j - 1] and h == p.entropies[j]
            if other.tree.nodes[-1] == node and p.nodes[-1] == node:
                continue  # two trajectories at one leaf: caught below
            # a shared node: the same turn objects (hence ids) all the way to the root
            assert all(a is b for a, b in zip(t.turns[:j], other.turns[:j], strict=True))
            assert other_turn is turn and t.prefix_ids(j) == other.prefix_ids(j)
        assert (p.tree, p.nodes[-1]) not in leaves
        leaves.add((p.tree, p.nodes[-1]))


def test_at2po_paper_shape_paths_and_batched_waves(scripted, toy_tokenizer):
    engine, retriever, tool = setup(scripted, toy_tokenizer, varied)
    trajs = rollout_at2po(QS, engine, tool, CFG, AT2PO, seed=3)
    assert [t.group_id for t in trajs] == ["q1"] * 22 + ["q2"] * 22
    assert {t.tree.tree for t in trajs} == {"q1#0", "q2#0"}
    check_forest(trajs)
    assert len({len(t.turns) for t in trajs}) == 3  # leaves at depths 1, 2 and 3
    # 10 chains, then 6 expansions per round, each one new leaf
    rounds = [t.extra.get("expansion", (None,))[0] for t in trajs[:22]]
    assert rounds == [None] * 10 + [0] * 6 + [1] * 6
    for t in trajs:
        if "expansion" not in t.extra:
            continue
        node = t.extra["expansion"][1]
        # a sibling of the expanded node: same parent, a new node at that depth
        owner = next(o for o in trajs if o.tree.tree == t.tree.tree and node in o.tree.nodes)
        depth = owner.tree.nodes.index(node)
        assert node == 0 or (t.tree.nodes[depth - 1] == owner.tree.nodes[depth - 1]
                             and t.tree.nodes[depth] != node)
    # one engine call and at most one retriever call per wave, across questions and trees
    assert len(retriever.batches) <= len(engine.calls)
    assert {q.split()[0] for q in retriever.batches[0]} == {"Foo", "Baz"}


def test_tree_grpo_paper_shape(scripted, toy_tokenizer):
    engine, _, tool = setup(scripted, toy_tokenizer, varied)
    trajs = rollout_tree_grpo(QS, engine, tool, CFG, TREE_GRPO, seed=1)
    assert [t.group_id for t in trajs] == ["q1"] * 6 + ["q2"] * 6
    assert [t.tree.tree for t in trajs] == ["q1#0"] * 3 + ["q1#1"] * 3 + ["q2#0"] * 3 + [
        "q2#1"] * 3
    check_forest(trajs)
    for t in trajs:
        if "expansion" in t.extra:
            # a continuation: the path goes through the expanded node (the root included)
            assert t.extra["expansion"][1] in t.tree.nodes[:-1]
    # K below the 1 + L·N leaves: K distinct leaves per tree
    fewer = rollout_tree_grpo(QS, engine, tool, CFG,
                              dataclasses.replace(TREE_GRPO, tree_k=2, n=4), seed=1)
    assert [t.tree.tree for t in fewer] == ["q1#0"] * 2 + ["q1#1"] * 2 + ["q2#0"] * 2 + [
        "q2#1"] * 2
    check_forest(fewer)
    with pytest.raises(ValueError, match="K <= 1"):
        rollout_tree_grpo(QS, engine, tool, CFG,
                          dataclasses.replace(TREE_GRPO, tree_k=4, n=8), seed=1)


def flat(user, turn, seed):
    """Every chain: search (H 0.2), search (H 0.9), answer (H 0.5)."""
    if turn == 2:
        return "<think> h5 </think> <answer> \\boxed{a1} </answer>"
    return f"<think> h{2 if turn == 0 else 9} </think> <search> Foo q{turn} </search>"


def expansions(trajs):
    by_round = defaultdict(list)
    for t in trajs:
        if "expansion" in t.extra:
            by_round[t.extra["expansion"][0]].append(t.extra["expansion"][1])
    return [by_round[r] for r in sorted(by_round)]


@pytest.mark.parametrize("alpha, second_round", [(0.05, [6, 4]), (0.0, [4, 5])])
def test_at2po_expands_top_scores_and_penalises_repeat_parents(scripted, toy_tokenizer, alpha,
                                                              second_round):
    # Three chains: nodes 1-3 (turn 1, H .2, under the root), 4-6 (turn 2, H .9, one under
    # each of 1-3), 7-9 (answers). Round 1 picks 4 and 5 (score .9, ties to the older node)
    # and regenerates them under 1 and 2. Round 2: 1 and 2 now have two children, so with
    # α = .05 node 6 (still an only child) ranks first; without the penalty 4 and 5 again.
    engine, _, tool = setup(scripted, toy_tokenizer, flat, entropy=True)
    shape = RolloutShapeConfig(shape="tree_entropy", n=7, tree_m=3, tree_l=2, tree_k=2,
                               expansion_penalty=alpha)
    trajs = rollout_at2po(QS[:1], engine, tool, CFG, shape, seed=0)
    assert [t.tree.entropies for t in trajs[:3]] == [pytest.approx((0.0, .2, .9, .5))] * 3
    assert [t.tree.nodes for t in trajs[:3]] == [(0, 1, 4, 7), (0, 2, 5, 8), (0, 3, 6, 9)]
    assert expansions(trajs) == [[4, 5], second_round]
    parents = [t.tree.nodes[1] for t in trajs[3:]]  # the new siblings' parents
    assert parents == ([1, 2, 3, 1] if alpha else [1, 2, 1, 2])
    check_forest(trajs)


def test_at2po_expansions_are_the_top_k_at_each_round(scripted, toy_tokenizer):
    # Rebuild, from the leaves made before each round, the tree that round saw and rank it.
    engine, _, tool = setup(scripted, toy_tokenizer, varied)
    trajs = rollout_at2po(QS, engine, tool, CFG, AT2PO, seed=5)
    for q in ("q1", "q2"):
        mine = [t for t in trajs if t.group_id == q]
        for r, chosen in enumerate(expansions(mine)):
            before = [t for t in mine if t.extra.get("expansion", (-1,))[0] < r]
            parent, entropy, children = {}, {0: 0.0}, defaultdict(set)
            for t in before:
                for j in range(1, len(t.tree.nodes)):
                    node = t.tree.nodes[j]
                    parent[node], entropy[node] = t.tree.nodes[j - 1], t.tree.entropies[j]
                    children[t.tree.nodes[j - 1]].add(node)
            score = {0: -0.05 * (len(children[0]) - 1)}
            for node in children:
                if node:
                    score[node] = entropy[node] - 0.05 * (len(children[parent[node]]) - 1)
            ranked = sorted(score, key=lambda i: (-score[i], i))
            assert chosen == ranked[:6]


def test_at2po_select_modes():
    scores = [(0, -0.45), (3, 0.7), (5, 0.9), (8, 0.7)]
    assert at2po_select(scores, 3, "entropy", random.Random(0)) == [5, 3, 8]
    # fewer candidates than K: the ranking repeats from the top
    assert at2po_select(scores, 6, "entropy", random.Random(0)) == [5, 3, 8, 0, 5, 3]
    picked = at2po_select(scores, 3, "random", random.Random(0))
    assert len(set(picked)) == 3 and set(picked) <= {0, 3, 5, 8}
    assert len(at2po_select(scores, 9, "random", random.Random(0))) == 9


@pytest.mark.parametrize("n, kept", [(5, 4), (3, 3)])
def test_at2po_duplicates_or_prunes_to_n(scripted, toy_tokenizer, n, kept):
    engine, _, tool = setup(scripted, toy_tokenizer, varied)
    shape = RolloutShapeConfig(shape="tree_entropy", n=n, tree_m=3, tree_l=1, tree_k=1)
    trajs = rollout_at2po(QS, engine, tool, CFG, shape, seed=2)
    assert [t.group_id for t in trajs] == ["q1"] * n + ["q2"] * n
    check_forest(trajs)  # duplicates end at leaf nodes of their own
    dups = [t for t in trajs if "duplicate_of" in t.extra]
    assert len(dups) == 2 * (n - kept)
    for d in dups:
        src = next(t for t in trajs if t.tree.tree == d.tree.tree
                   and t.tree.nodes[-1] == d.extra["duplicate_of"])
        assert d.turns == src.turns and d.tree.entropies == src.tree.entropies
        assert d.tree.nodes[:-1] == src.tree.nodes[:-1] and d.tree.nodes[-1] != src.tree.nodes[-1]


def rising(user, turn, seed):
    """Three searches then an answer; the step entropy rises by 2.5 a turn."""
    h = 5 + 25 * turn
    if turn == 3:
        return f"<think> h{h} </think> <answer> \\boxed{{a{seed % 3}}} </answer>"
    return f"<think> h{h} </think> <search> Foo q{seed % 4} </search>"


def falling(user, turn, seed):
    return rising(user, turn, seed).replace(f"h{5 + 25 * turn}", f"h{80 - 25 * turn}")


def test_aepo_reaches_n_and_branches_more_when_entropy_rises(scripted, toy_tokenizer):
    # Two initial chains of 16, so branching (not fresh chains) must do most of the filling.
    # A chain's first own step has H_now = H_init (p = U); at later steps rising entropy adds
    # w·ΔH >= +0.5 to p (it branches unless the consecutive-branch decay bites), falling
    # entropy subtracts as much (it never branches).
    qs = [Question(f"q{i}", f"Question number {i}", ("a1",)) for i in range(4)]
    shape = dataclasses.replace(AEPO, aepo_initial=2)
    branches, late = {}, {}
    for name, script in (("rising", rising), ("falling", falling)):
        engine, _, tool = setup(scripted, toy_tokenizer, script, entropy=True)
        trajs = rollout_aepo(qs, engine, tool, CFG, shape, seed=0)
        assert [t.group_id for t in trajs] == [q.id for q in qs for _ in range(16)]
        assert all(t.tree is None for t in trajs)
        for i in range(0, len(trajs), 16):
            group = trajs[i:i + 16]
            assert all(t.extra["aepo_parent"] is None for t in group[:2])
            for pos, t in enumerate(group):
                j, k = t.extra["aepo_parent"], t.extra["aepo_shared_turns"]
                if j is not None:  # a copy shares its source's turns (the same objects)
                    assert 0 < k < len(t.turns) and j < pos
                    assert all(a is b for a, b in zip(t.turns[:k], group[j].turns[:k], strict=True))
        copies = [(group[t.extra["aepo_parent"]], t) for i in range(0, len(trajs), 16)
                  for group in [trajs[i:i + 16]] for t in group
                  if t.extra["aepo_parent"] is not None]
        branches[name] = len(copies)
        # a copy made after its source's turn k-1; the source's own steps start at its
        # shared turns, so a later k means a branch after the source's first own step
        late[name] = sum(t.extra["aepo_shared_turns"] - 1 > src.extra["aepo_shared_turns"]
                         for src, t in copies)
    assert late["falling"] == 0 and late["rising"] > branches["rising"] / 2
    assert branches["rising"] > branches["falling"]


@pytest.mark.parametrize("fn, shape", [
    (rollout_at2po, AT2PO), (rollout_at2po, dataclasses.replace(AT2PO, node_select="random")),
    (rollout_tree_grpo, TREE_GRPO), (rollout_aepo, AEPO)])
def test_same_seed_same_trajectories(scripted, toy_tokenizer, fn, shape):
    def run(seed):
        engine, _, tool = setup(scripted, toy_tokenizer, varied)
        return [(t.turns, t.tree, t.extra) for t in fn(QS, engine, tool, CFG, shape, seed=seed)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_turn_advantages_accept_tree_rollouts(scripted, toy_tokenizer):
    engine, _, tool = setup(scripted, toy_tokenizer, varied)
    for method, fn, shape in (("at2po", rollout_at2po, AT2PO),
                              ("tree_grpo", rollout_tree_grpo, TREE_GRPO)):
        trajs = fn(QS, engine, tool, CFG, shape, seed=4)
        dicts = [{"group": t.group_id,
                  "reward": 1.0 if "a1" in toy_tokenizer.decode(t.turns[-1].action_ids)
                  else -1.0,
                  "tree": t.tree.tree, "nodes": list(t.tree.nodes),
                  "entropies": list(t.tree.entropies)} for t in trajs]
        assert len({d["reward"] for d in dicts}) == 2
        out = turn_advantages(method, dicts)
        assert [len(a.advantages) for a in out] == [len(t.turns) for t in trajs]
        assert any(x != 0 for a in out for x in a.advantages)
