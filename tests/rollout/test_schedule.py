"""The per-trajectory schedule (agent.run_trajectories) against waves: the same trajectories
whatever order the engine finishes requests in, no observation on another trajectory, seeds
per (trajectory, turn); on the hf engine in fp32, the same ids and logprobs as waves for every
method of the main set; the engine's `Batching` adapter; the rollout's time split."""

import dataclasses
import random
from types import SimpleNamespace

import pytest
from conftest import FixedRetriever, ScriptedEngine

from a2tgpo.algo.methods import RolloutShapeConfig, get_method
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.ops.preemption import StopRequested, _requests
from a2tgpo.retrieval.retriever import RetrievalConfig
from a2tgpo.rollout.agent import AgentConfig, Question, SearchTool, _seed, rollout_chains
from a2tgpo.rollout.engine import Batching, Generation, SamplingParams
from a2tgpo.rollout.trees import rollout_at2po, rollout_tree_grpo
from a2tgpo.train import episodes

SEARCH = RetrievalConfig()
CFG = AgentConfig(max_turn_tokens=64, max_response_tokens=900, max_obs_tokens=60,
                  schedule="waves")
TRAJ = dataclasses.replace(CFG, schedule="trajectory")
QS = [Question("q1", "Who directed Foo", ("Bar",)), Question("q2", "Where is Baz", ("Qux",))]
MAIN_SET = ("grpo", "dapo", "gspo", "tree_grpo", "gigpo", "igpo", "aepo", "at2po", "a2tgpo")


def seeded(user, turn, seed):
    """Searches while the turn's seed says so (at most 4 turns), each query naming the seed:
    trajectories differ in length, and an observation, a query or a logprob that reached the
    wrong trajectory or turn shows in its ids."""
    if turn < 4 and seed % 3:
        return f"<think> t{turn} </think> <search> {user.split()[-1]} s{seed} </search>"
    return f"<answer> \\boxed{{a{seed % 11}}} </answer>"


class ShuffledEngine(ScriptedEngine):
    """The scripted engine as a `Streaming` one that finishes a random non-empty subset of the
    pending requests (at most half) at each `wait_any`, in random order (`order` seeds it)."""

    def __init__(self, tokenizer, script, eos_id, order: int):
        super().__init__(tokenizer, script, eos_id)
        self.rng, self.pending, self.waits = random.Random(order), [], 0

    def submit(self, prompt_ids, params, seed):
        from concurrent.futures import Future

        fut = Future()
        self.pending.append((list(prompt_ids), params, seed, fut))
        return fut

    def wait_any(self):
        self.waits += 1
        self.rng.shuffle(self.pending)
        k = self.rng.randint(1, (len(self.pending) + 1) // 2) if self.pending else 0
        done, self.pending = self.pending[:k], self.pending[k:]
        for p, params, seed, fut in done:
            fut.set_result(self.generate([p], params, [seed])[0])

    def cancel(self):
        self.cancelled, self.pending = len(self.pending), []


def _ids(trajs):
    return [(t.group_id, t.prompt_ids,
             [(x.action_ids, x.action_logprobs, x.obs_ids, x.stop, x.query) for x in t.turns],
             t.tree) for t in trajs]


SHAPES = {
    "chains": lambda e, tool, cfg: rollout_chains(QS, 8, e, tool, cfg, seed=5),
    "tree_grpo": lambda e, tool, cfg: rollout_tree_grpo(
        QS, e, tool, cfg, RolloutShapeConfig(shape="tree_random", n=6, tree_m=2, tree_n=2,
                                             tree_l=1, tree_k=3), seed=5),
    "at2po": lambda e, tool, cfg: rollout_at2po(
        QS, e, tool, cfg, RolloutShapeConfig(shape="tree_entropy", n=8, tree_m=4, tree_l=2,
                                             tree_k=2), seed=5),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("order", [0, 1, 2])
def test_any_completion_order_gives_the_waves_trajectories(toy_tokenizer, shape, order):
    tok = toy_tokenizer
    in_waves, by_wave = ScriptedEngine(tok, seeded, tok.eos_token_id), FixedRetriever()
    waves = SHAPES[shape](in_waves, SearchTool(by_wave, tok, CFG, SEARCH), CFG)
    engine, retriever = ShuffledEngine(tok, seeded, tok.eos_token_id, order), FixedRetriever()
    mine = SHAPES[shape](engine, SearchTool(retriever, tok, TRAJ, SEARCH), TRAJ)
    assert _ids(mine) == _ids(waves)
    # the schedule really interleaved: more engine waits than waves, and more retriever calls
    # (each of whatever was pending)
    assert engine.waits > len(in_waves.calls) and len(retriever.batches) > len(by_wave.batches)
    turns = [x for t in mine for x in t.turns]
    assert {x.stop for x in turns} == {"search", "answer"}
    assert len({x.query for x in turns if x.query}) > 6
    for x in turns:
        if x.stop == "search":  # each observation names its own turn's query
            assert f'"{x.query}"' in tok.decode(x.obs_ids)


def test_chain_seeds_are_per_trajectory_and_turn(toy_tokenizer):
    """Chain i's turn k is sampled with _seed(5, i, k), whatever order requests finish in
    (the script's logprob is -(1 + seed % 7)/10 and its query names the seed)."""
    tok = toy_tokenizer
    engine = ShuffledEngine(tok, seeded, tok.eos_token_id, order=7)
    trajs = rollout_chains(QS, 3, engine, SearchTool(FixedRetriever(), tok, TRAJ, SEARCH), TRAJ,
                           seed=5)
    for i, t in enumerate(trajs):
        for k, x in enumerate(t.turns):
            s = _seed(5, i, k)
            assert x.action_logprobs[0] == pytest.approx(-(1 + s % 7) / 10)
            assert (x.query or "").endswith(f" s{s}") == (x.stop == "search")


def test_batching_runs_pending_requests_in_one_call_and_cuts_to_each_max_tokens():
    calls = []

    class Counting:
        def generate(self, prompts, params, seeds=None):
            calls.append((len(prompts), params.max_tokens, tuple(seeds)))
            # ten ids per prompt, the stop string "</x>" on none of them
            return [Generation(tuple(range(10)), (-0.5,) * 10, "length") for _ in prompts]

    b = Batching(Counting())
    f1 = b.submit([1], SamplingParams(max_tokens=10), 11)
    f2 = b.submit([2], SamplingParams(max_tokens=4), 12)
    f3 = b.submit([3], SamplingParams(max_tokens=4, greedy=True), 13)
    assert not f1.done()
    b.wait_any()
    # f1 and f2 differ only in max_tokens: one call of the larger; f3 samples otherwise
    assert calls == [(2, 10, (11, 12)), (1, 4, (13,))]
    assert f1.result().token_ids == tuple(range(10))
    assert f2.result() == f3.result() == Generation((0, 1, 2, 3), (-0.5,) * 4, "length")


def test_a_stop_request_ends_the_trajectory_schedule_and_cancels_its_requests(toy_tokenizer):
    tok = toy_tokenizer
    engine = ShuffledEngine(tok, seeded, tok.eos_token_id, order=1)
    tool = SearchTool(FixedRetriever(), tok, TRAJ, SEARCH)
    orig = engine.wait_any

    def stop_after_first():
        orig()
        _requests.append("test")

    engine.wait_any = stop_after_first
    try:
        with pytest.raises(StopRequested):
            rollout_chains(QS, 2, engine, tool, TRAJ, seed=0)
    finally:
        _requests.clear()
    assert engine.waits == 1
    # the requests still pending were dropped from the engine (cancel), none left behind
    assert engine.cancelled > 0 and engine.pending == []


def test_stats_split_the_rollout_time(toy_tokenizer):
    tok = toy_tokenizer
    for cfg in (CFG, TRAJ):
        engine = ScriptedEngine(tok, seeded, tok.eos_token_id)
        tool = SearchTool(FixedRetriever(), tok, cfg, SEARCH)
        trajs = rollout_chains(QS, 3, engine, tool, cfg, seed=5)
        s = tool.stats.take()
        assert s.trajectories == len(trajs) == 6
        assert s.engine_busy_s > 0 and s.search_wait_s > 0 and s.longest_s > 0
        assert tool.stats.take().trajectories == 0  # counted once


# --------------------------------------------------------------------------------------------
# the hf engine in fp32, every method of the main set


@pytest.fixture(scope="module")
def hf(toy_dir):
    from a2tgpo.model.backbone import load_model, load_tokenizer
    from a2tgpo.rollout.hf_engine import HfEngine

    cfg = BackboneConfig(id="toy", path=str(toy_dir / "backbone"), dtype="float32")
    model, tok = load_model(cfg), load_tokenizer(cfg)
    # an untrained model samples nearly uniformly: with every 12th id counted as an end of
    # sequence about half the 8-token turns end at EOS, so trajectories end at different turns
    eos = list(range(0, len(tok), 12))
    return lambda: HfEngine(model, tok, eos_token_ids=eos), tok


@pytest.mark.parametrize("method", MAIN_SET)
def test_hf_fp32_same_trajectories_as_waves(hf, method):
    """The toy backbone is an untrained model: it never closes a search, so trajectories go on
    by Search-R1's retry message (after an invalid or max_tokens turn) and end at EOS or the
    length limit, at different turns: the batches shrink as in a real rollout."""
    make, tok = hf
    shape = get_method(method).rollout
    out = {}
    for schedule in ("waves", "trajectory"):
        agent = AgentConfig(max_turn_tokens=8, max_response_tokens=120, max_obs_tokens=20,
                            on_invalid="retry", schedule=schedule)
        cfg = SimpleNamespace(method=SimpleNamespace(rollout=shape), rollout=agent,
                              backbone=BackboneConfig(id="toy", path="unused"))
        tool = SearchTool(FixedRetriever(), tok, agent, SEARCH)
        out[schedule] = episodes.rollout(cfg, QS[:1], make(), tool, seed=3)
    assert _ids(out["trajectory"]) == _ids(out["waves"])
    assert len({len(t.turns) for t in out["waves"]}) > 1  # trajectories of several lengths


def test_tree_nodes_are_numbered_in_wave_order_after_a_whole_phase():
    """Two chains of two turns each, registered once after both ended (the trajectory
    schedule), get the ids one registration per wave gives: wave 1 numbers both first turns
    (1, 2), wave 2 both second turns (3, 4)."""
    from a2tgpo.rollout.trajectory import TrajectoryBuilder, Turn
    from a2tgpo.rollout.trees import RolloutTree

    tree = RolloutTree("q#0")
    a, b = (tree.add(TrajectoryBuilder([1, 2], question_id="q", group_id="q",
                                       golden_answers=("x",))) for _ in range(2))
    for builder in (a, b):
        for k in range(2):
            builder.add_turn(Turn((10 + k,), (-0.5,), (20,) if k == 0 else (), "search", "x",
                                  0.5), builder.ids)
    tree.register()
    assert a.node_ids == [1, 3] and b.node_ids == [2, 4]
    assert [n.parent for n in tree.nodes[1:]] == [0, 0, 1, 2]


def test_rollout_times_per_step():
    from a2tgpo.rollout.agent import RolloutStats
    from a2tgpo.train.rl import ROLLOUT_TIMES, rollout_times

    # 10 s of rollouts, the engine busy for 6 of them; 4 trajectories waited 3 s on search in
    # all (0.75 s each); the longest took 8 s
    got = rollout_times(10.0, RolloutStats(engine_busy_s=6.0, search_wait_s=3.0, longest_s=8.0,
                                           trajectories=4))
    assert got == {"seconds": 10.0, "engine_busy": 0.6, "longest_trajectory_s": 8.0,
                   "search_wait_s": 0.75}
    assert tuple(got) == ROLLOUT_TIMES
    assert rollout_times(0.0, RolloutStats())["engine_busy"] == 0.0  # a rank without questions
