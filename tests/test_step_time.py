"""The step-time model (a2tgpo.timing): the roofline by hand, the virtual clock's schedule of two
trajectories by hand under both schedules, and the FLOPs of the training passes."""

import dataclasses
import math

import pytest

from a2tgpo import timing
from a2tgpo.model.backbone import load_backbone_config
from a2tgpo.plan import count_parameters
from a2tgpo.rollout.agent import AgentConfig, _seed


def _qwen3_4b() -> timing.ModelCost:
    arch = load_backbone_config("config/backbones/qwen3-4b.yaml").architecture
    return timing.ModelCost.of(arch, count_parameters(arch)[0])


def test_one_decode_step_of_qwen3_4b_on_an_h20_by_hand():
    m = _qwen3_4b()
    assert m.params == 4_022_468_096  # tests/test_plan.py: transformers' own count
    # K and V, 36 layers, 8 kv heads x 128, 2 B: 2 x 36 x 1024 x 2
    assert m.kv_bytes_per_token == 147_456
    # 128 sequences at 2,048 tokens of context, one new token each
    step = timing.engine_step(timing.GPUS["h20"], m, tokens=128, kv_tokens=128 * 2048,
                              attn_pairs=128 * 2048)
    # weights 2P = 8,044,936,192 B + KV 262,144 x 147,456 = 38,654,705,664 B
    assert step.bytes == 46_699_641_856
    # 2P x 128 = 1,029,751,832,576 + attention 4 x 36 x 4096 x 262,144 = 154,618,822,656
    assert step.flops == 1_184_370_655_232
    # memory: 46.70e9 / (4.0e12 x 0.8) = 14.594 ms > compute: 1.184e12 / (148e12 x 0.7) =
    # 11.432 ms; + 4 ms overhead
    assert step.seconds == pytest.approx(46_699_641_856 / 3.2e12 + 0.004, rel=1e-12)
    assert step.seconds == pytest.approx(0.0185936, abs=1e-7)
    # the same step on an H100 SXM: 46.70e9 / (3.35e12 x 0.8) = 17.425 ms, + 4 ms
    h100 = timing.engine_step(timing.GPUS["h100"], m, tokens=128, kv_tokens=128 * 2048,
                              attn_pairs=128 * 2048)
    assert h100.seconds == pytest.approx(0.0214252, abs=1e-7)


def test_kv_capacity_and_forward_flops_by_hand():
    m = _qwen3_4b()
    # 0.6 x 96 GiB = 61,847,529,062 B - weights 8,044,936,192 - reserve 2 GiB 2,147,483,648
    # = 51,655,109,222 B / 147,456 B = 350,308.97: 350,308 whole tokens
    assert timing.kv_capacity_tokens(timing.GPUS["h20"], m, 0.6) == 350_308
    # a row of 1,000 tokens: 2P x 1000 + 2 x 36 x 4096 x 1000^2
    assert m.forward_flops(1000) == 2 * 4_022_468_096 * 1000 + 294_912_000_000


def test_a_named_gpu_with_numbers_of_its_own():
    g = timing.gpu_spec("h20", hbm_tb_s=3.0, step_overhead_ms=10)
    assert (g.hbm_bytes_per_s, g.bf16_flops, g.step_overhead_s) == (3.0e12, 148e12, 0.01)
    with pytest.raises(ValueError, match="unknown GPU 'b200'"):
        timing.gpu_spec("b200")


# A GPU whose steps cost exactly the overhead (no bytes or FLOPs count): 10 ms a step
TICK = dataclasses.replace(timing.GPUS["h100"], hbm_bytes_per_s=1e40, bf16_flops=1e40,
                           step_overhead_s=0.01)


def _two(schedule: str):
    """Two trajectories of one question, their turns scripted: A searches after 10 tokens
    and answers after 40; B searches after 30 and answers after 10."""
    script = {_seed(0, 0, 0): (10, False), _seed(0, 0, 1): (40, True),
              _seed(0, 1, 0): (30, False), _seed(0, 1, 1): (10, True)}
    builders: list = []
    t = timing.simulate_rank(TICK, _qwen3_4b(), timing.SHAPES["grpo"], questions=1, n=2,
                             agent_cfg=AgentConfig(max_turn_tokens=200, max_response_tokens=2000),
                             schedule=schedule, script=script, out=builders)
    return t, builders


def test_the_virtual_clock_schedules_two_trajectories_as_by_hand():
    waves, wb = _two("waves")
    traj, tb = _two("trajectory")
    # a request's prefill samples its first token: n tokens take n steps of 10 ms
    # waves: turn 1 max(10, 30) = 30 steps = 0.30 s; one search of 2 queries 50 + 2 x 2 ms =
    # 0.054 s; turn 2 max(40, 10) = 40 steps: 0.30 + 0.054 + 0.40 = 0.754 s
    assert waves.seconds == pytest.approx(0.754)
    # trajectory: A's search (1 query, 52 ms) goes out at 0.10 and returns at 0.152, during
    # B's turn; A's next turn joins at the next step boundary, 0.16, and ends 40 steps later
    # at 0.56. B searches at 0.30, returns at 0.352 (A still decoding), joins at 0.36, ends at
    # 0.46. The rollout ends with A at 0.56 s
    assert traj.seconds == pytest.approx(0.56)
    assert traj.longest_trajectory_s == pytest.approx(0.56)  # A: 0 -> 0.56
    # waves: B's second turn ends with the wave at 0.754; A's too
    assert waves.longest_trajectory_s == pytest.approx(0.754)
    # the engine had work all along but during the wave's search (0.054 s)
    assert waves.busy_s == pytest.approx(0.70)
    assert traj.busy_s == pytest.approx(0.56)
    # searches: waves 2 trajectories x 0.054 s, trajectory 2 x 0.052 s, per trajectory
    assert (waves.search_wait_s, traj.search_wait_s) == (pytest.approx(0.054),
                                                         pytest.approx(0.052))
    # the same trajectories, token for token: only time differs
    for a, b in zip(wb, tb, strict=True):
        assert a.ids == b.ids and [t.stop for t in a.turns] == [t.stop for t in b.turns]
    assert [[t.stop for t in b.turns] for b in wb] == [["search", "answer"]] * 2
    assert [len(t.action_ids) for t in wb[0].turns] == [10, 40]


def test_the_kv_cache_bounds_what_runs_at_once():
    """A cache of 1,000 tokens: two 600-token prompts of 5 tokens each cannot both be in
    flight, so the second is admitted when the first ends (steps 0-4, then 5-9); with 2,000
    they run together (steps 0-4)."""
    def two_requests(kv_capacity: int) -> timing.VirtualEngine:
        eng = timing.VirtualEngine(TICK, _qwen3_4b(), kv_capacity=kv_capacity)
        clock = timing.VirtualClock(eng)
        w = timing._Waiter(2)
        with clock.client():
            for _ in range(2):
                clock.submit(600, 600, 5, lambda r: clock.release(w))
            clock.wait(w)
        return eng

    eng = two_requests(1000)
    assert eng.steps == 10 and eng.now == pytest.approx(0.10)
    assert two_requests(2000).steps == 5


def test_training_passes_by_hand():
    m = _qwen3_4b()
    gpu = timing.GPUS["h100"]
    rate = 8 * 989e12 * 0.5
    lengths, prefixes = [1000, 2000], [(400, 900), (1500,)]
    full = m.forward_flops(1000) + m.forward_flops(2000)
    grpo = timing.training_seconds(m, lengths, prefixes, gpu=gpu, gpus=8, mfu=0.5,
                                   reference=True)
    assert grpo["old_logprob"] == grpo["reference"] == pytest.approx(full / rate)
    # forward, recompute and a backward of two forwards, over packed micro-batches
    assert grpo["update"] == pytest.approx(4 * full * timing.PACKING / rate)
    assert grpo["ig"] == 0
    per_prefix = timing.training_seconds(m, lengths, prefixes, gpu=gpu, gpus=8, mfu=0.5,
                                         ig="per_prefix")
    rows = sum(m.forward_flops(e + timing.PROBE_TOKENS) for e in (400, 900, 1500))
    assert per_prefix["ig"] == pytest.approx((full + rows) / rate)
    assert per_prefix["old_logprob"] == 0  # the same call gives them
    fused = timing.training_seconds(m, lengths, prefixes, gpu=gpu, gpus=8, mfu=0.5, ig="fused")
    # 3 turns' probes of 30 tokens, each at 2P + attention over its row
    probes = 2 * 30 * (2 * m.params + 4 * 36 * 4096 * 1000) \
        + 30 * (2 * m.params + 4 * 36 * 4096 * 2000)
    assert fused["ig"] == pytest.approx((full + probes) / rate)


def test_simulated_trajectories_follow_their_shape():
    """The simulated policy's tool calls per answer follow MULTI_HOP_CALLS (A2TGPO App. C.4:
    mean 0.03 + 2 x 0.20 + 3 x 0.27 + 4 x 0.25 + 5 x 0.12 + 6 x 0.105 = 3.47, 72% at 2-4, 2.5%
    none) and its turns the shape's median, over 1,024 trajectories with room for all."""
    builders: list = []
    timing.simulate_rank(TICK, _qwen3_4b(), timing.SHAPES["a2tgpo"], questions=64, n=16,
                         agent_cfg=AgentConfig(max_turn_tokens=50_000,
                                               max_response_tokens=50_000),
                         out=builders)
    calls = [sum(t.stop == "search" for t in b.turns) for b in builders]
    assert all(b.turns[-1].stop == "answer" for b in builders)
    # sampling error of a mean of 1,024 (sd ~1.3): ~0.04
    assert sum(calls) / len(calls) == pytest.approx(3.47, abs=0.15)
    assert sum(2 <= c <= 4 for c in calls) / len(calls) == pytest.approx(0.72, abs=0.04)
    assert sum(c == 0 for c in calls) / len(calls) == pytest.approx(0.025, abs=0.015)
    turns = sorted(len(t.action_ids) for b in builders for t in b.turns)
    assert turns[len(turns) // 2] == pytest.approx(120, rel=0.06)
    # observations: U(350, 500) tokens of passages between the result tags
    obs = [len(t.obs_ids) for b in builders for t in b.turns if t.stop == "search"]
    assert 350 <= min(obs) - 2 and max(obs) - 2 <= 500


def test_summed_decode_steps_cost_what_single_steps_cost():
    """`advance` sums decode-only steps without their bookkeeping: on the H20 roofline, with
    requests of other lengths arriving over time and a cache that forces a wait, it ends
    every request at the time and step that `step` alone gives."""
    def run(use_advance: bool):
        eng = timing.VirtualEngine(timing.GPUS["h20"], _qwen3_4b(), kv_capacity=6000)
        ends = {}
        for k, (ctx, n) in enumerate([(900, 700), (1500, 40), (2000, 300), (2500, 5),
                                      (800, 1200)]):
            eng.add(timing._Req(ctx, ctx, n, None, k))
        while eng.has_work:
            for r in (eng.advance(math.inf) if use_advance else eng.step()):
                ends[r.seq] = (r.done_at, eng.steps)
        return ends, eng.busy_s, eng.preempted

    fast, slow = run(True), run(False)
    assert fast[0].keys() == slow[0].keys() == set(range(5))
    for k in range(5):
        assert fast[0][k][1] == slow[0][k][1]
        assert fast[0][k][0] == pytest.approx(slow[0][k][0], rel=1e-12)
    assert fast[1] == pytest.approx(slow[1], rel=1e-12) and fast[2] == slow[2]
