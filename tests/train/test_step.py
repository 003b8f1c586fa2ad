"""One trainer step on a fixed tiny batch, derived by hand: the token advantages and the
per-token clip bounds that `policy_loss` receives from `rl.train_step`.

Two questions x 3 trajectories with chosen turns, rewards and gold-answer probabilities at the
probe points; the sampling (steps 1-4) and the IG/old-log-prob forward (step 5) are replaced
by those chosen values, everything after them (reference log-probs, IG arithmetic, tool-call
-> turn mapping, estimators, broadcast to tokens, the update) is the trainer's own code.

Turns: S = search (an observation follows), I = invalid action, retried (the episode goes on
with an error message, no tool call: turn k is not tool call k), A = answer.

    q1  b0  S S A      p = .1 .3 .6   R =  1
        b1  S I S A    p = .1 .5 .4   R =  0
        b2  S S A      p = .1 .4 .3   R = -1
    q2  b3  S A        p = .2 .6      R =  1
        b4  S A        p = .2 .4      R =  1
        b5  A          p = .2         R = -1

p[t] is the gold answer's probability after tool call t (p[0]: the question alone); the
trainer receives log p. Information gain, paper reading (prob): IG of call t = p[t] − p[t−1],
on the turn that made the call:
    b0: turn 0 +.2, turn 1 +.3    b1: turn 0 +.4, turn 2 −.1    b2: turn 0 +.3, turn 1 −.1
    b3: turn 0 +.4                b4: turn 0 +.2
Released code's reading (log_prob, the first call only sets the baseline): b0 turn 1 log 2,
b1 turn 2 log .8, b2 turn 1 log .75; q2 none.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.algo.types import TreePath
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.rollout.hf_engine import HfEngine
from a2tgpo.rollout.info_gain import gold_logprob_matrix
from a2tgpo.rollout.trajectory import Trajectory, Turn
from a2tgpo.train import rl, update
from a2tgpo.train.config import ScheduleConfig, TrainConfig
from a2tgpo.train.distributed import EnginePlacement, SingleBackend
from a2tgpo.train.reference import ReferencePolicy

EPS = 1e-6  # AdvantageConfig.eps: added to every std
PROMPT = (1, 2)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def turn(k: int, stop: str) -> Turn:
    """Two sampled tokens per turn; an observation token after every non-final turn."""
    return Turn((10 + k, 20 + k), (-0.5, -0.5), () if stop == "answer" else (30,), stop,
                entropy=0.5)


def chain(q: str, stops: str, reward: float, tree: TreePath | None = None,
          turns: tuple[Turn, ...] | None = None) -> Trajectory:
    code = {"S": "search", "I": "invalid", "A": "answer"}
    turns = turns or tuple(turn(k, code[c]) for k, c in enumerate(stops))
    return Trajectory(PROMPT, turns, q, q, ("gold",), reward=reward, tree=tree,
                      extra={"em": float(reward == 1), "f1": 0.0, "format_ok": True})


CHAINS = [chain("q1", "SSA", 1.0), chain("q1", "SISA", 0.0), chain("q1", "SSA", -1.0),
          chain("q2", "SA", 1.0), chain("q2", "SA", 1.0), chain("q2", "A", -1.0)]
GOLD_P = [[.1, .3, .6], [.1, .5, .4], [.1, .4, .3], [.2, .6], [.2, .4], [.2]]

# AT2PO: one tree per question (tree label 0 in both: trees are keyed by question too).
#   q1: root -> a (H .5) -> l1 (H .2, R 1), l2 (H .6, R 0);  root -> b (H .4, R -1)
#   q2: root -> c (H .3) -> l3 (H .1, R 1), l4 (H .3, R 1);  root -> d (H .2, R -1)
_A, _C = turn(0, "search"), turn(0, "search")  # shared first turns of the two subtrees
TREES = [
    chain("q1", "", 1.0, TreePath(0, ("r", "a", "l1"), (0, .5, .2)), (_A, turn(1, "answer"))),
    chain("q1", "", 0.0, TreePath(0, ("r", "a", "l2"), (0, .5, .6)), (_A, turn(1, "answer"))),
    chain("q1", "", -1.0, TreePath(0, ("r", "b"), (0, .4)), (turn(0, "answer"),)),
    chain("q2", "", 1.0, TreePath(0, ("r", "c", "l3"), (0, .3, .1)), (_C, turn(1, "answer"))),
    chain("q2", "", 1.0, TreePath(0, ("r", "c", "l4"), (0, .3, .3)), (_C, turn(1, "answer"))),
    chain("q2", "", -1.0, TreePath(0, ("r", "d"), (0, .2)), (turn(0, "answer"),)),
]

# outcome z-scores within each question, population std (IGPO family, AT2PO leaf norm):
#   q1 {1, 0, −1}: mean 0, σ = √(2/3);  q2 {1, 1, −1}: mean 1/3, σ = 2√2/3
S1, S2 = math.sqrt(2 / 3), 2 * math.sqrt(2) / 3
R_HAT = [1 / (S1 + EPS), 0.0, -1 / (S1 + EPS),
         (2 / 3) / (S2 + EPS), (2 / 3) / (S2 + EPS), (-4 / 3) / (S2 + EPS)]


def grpo_expected():
    # verl GRPO: unbiased std, broadcast to every turn. q1: mean 0, std 1;
    # q2: mean 1/3, std √(((2/3)²·2 + (4/3)²)/2) = 2/√3
    s2 = 2 / math.sqrt(3)
    a = [1 / (1 + EPS), 0.0, -1 / (1 + EPS), (2 / 3) / (s2 + EPS), (2 / 3) / (s2 + EPS),
         (-4 / 3) / (s2 + EPS)]
    return [[a[b]] * len(t.turns) for b, t in enumerate(CHAINS)], None


def a2tgpo_expected():
    # turn-group pools (prompt, turn index), population std; a pool of one normalises to 0:
    #   q1 turn 0 {.2, .4, .3}: mean .3, σ0 = .1·√(2/3) -> b0 −.1/σ0, b1 +.1/σ0, b2 0
    #   q1 turn 1 {.3 (b0), −.1 (b2)}: mean .1, σ = .2 -> ±1;  q1 turn 2 {−.1 (b1)} -> 0
    #   q2 turn 0 {.4, .2}: mean .3, σ = .1 -> ±1
    s0 = 0.1 * math.sqrt(2 / 3)
    g = {(0, 0): -0.1 / (s0 + EPS), (1, 0): 0.1 / (s0 + EPS), (2, 0): 0.0,
         (0, 1): 0.2 / (0.2 + EPS), (2, 1): -0.2 / (0.2 + EPS), (1, 2): 0.0,
         (3, 0): 0.1 / (0.1 + EPS), (4, 0): -0.1 / (0.1 + EPS)}
    r = R_HAT
    # A_t = Σ_{k>=t} îg_k / √(#IG terms) + R̂ on process turns, R̂ on the final turn
    # (b1's turn 1 has no IG: its D_1 = îg_2 = 0 over n_1 = 1)
    adv = [[(g[0, 0] + g[0, 1]) / math.sqrt(2) + r[0], g[0, 1] + r[0], r[0]],
           [(g[1, 0] + g[1, 2]) / math.sqrt(2) + r[1], g[1, 2] + r[1], g[1, 2] + r[1], r[1]],
           [(g[2, 0] + g[2, 1]) / math.sqrt(2) + r[2], g[2, 1] + r[2], r[2]],
           [g[3, 0] + r[3], r[3]], [g[4, 0] + r[4], r[4]], [r[5]]]
    # c = 1 + β(2σ(îg) − 1), β = 0.3, on turns with an IG; 1 elsewhere
    clip = [[1.0] * len(row) for row in adv]
    for (b, k), v in g.items():
        clip[b][k] = 1 + 0.3 * (2 * sigmoid(v) - 1)
    return adv, clip


def a2tgpo_release_expected():
    # log-prob IG, no IG on the first call, process weight 0.3; pools: q1 turn 1
    # {log 2 (b0), log .75 (b2)}: ±1 (σ = (log 2 − log .75)/2); q1 turn 2 {log .8} -> 0
    s = (math.log(2) - math.log(0.75)) / 2
    g01, g21 = s / (s + EPS), -s / (s + EPS)
    r = R_HAT
    # b0: turn 0 has no IG but D_0 = îg_1 over n_0 = 1; b1: only turn 2 (îg 0); q2: no IG,
    # so A = R̂
    adv = [[0.3 * g01 + r[0], 0.3 * g01 + r[0], r[0]], [r[1]] * 4,
           [0.3 * g21 + r[2], 0.3 * g21 + r[2], r[2]], [r[3]] * 2, [r[4]] * 2, [r[5]]]
    clip = [[1.0] * len(row) for row in adv]
    clip[0][1] = 1 + 0.3 * (2 * sigmoid(g01) - 1)
    clip[2][1] = 1 + 0.3 * (2 * sigmoid(g21) - 1)
    return adv, clip


def igpo_expected():
    # IGPO paper: one pool per prompt of all its IG values AND its outcomes (population std);
    # A_t = Σ_{k>=t} îg_k + γ^(T−1−t) R̂ with γ = 1, no √n; A_{T−1} = R̂
    ig = {0: [.2, .3], 1: [.4, None, -.1], 2: [.3, -.1], 3: [.4], 4: [.2], 5: []}
    reward = [1.0, 0.0, -1.0, 1.0, 1.0, -1.0]
    adv = []
    for q in ((0, 1, 2), (3, 4, 5)):
        pool = [v for b in q for v in ig[b] if v is not None] + [reward[b] for b in q]
        mu, sd = statistics.fmean(pool), statistics.pstdev(pool)
        z = lambda x, mu=mu, sd=sd: (x - mu) / (sd + EPS)  # noqa: E731
        for b in q:
            igs = [0.0 if v is None else z(v) for v in ig[b]]  # turns without IG add nothing
            adv.append([sum(igs[k:]) + z(reward[b]) for k in range(len(igs))] + [z(reward[b])])
    return adv, None


def at2po_expected():
    # leaf values: rewards z-scored per tree (population std): q1 z1 = 1/(√(2/3) + eps), 0, −z1;
    # q2 u = (2/3)/(2√2/3 + eps), u, w = (−4/3)/(2√2/3 + eps). Inner node: entropy-weighted
    # children, V(a) = (.2·z1 + .6·0)/.8 = z1/4, V(c) = (.1u + .3u)/.4 = u. A = V per node,
    # turn k of a path = node k+1.
    z1, u, w = R_HAT[0], R_HAT[3], R_HAT[5]
    return [[z1 / 4, z1], [z1 / 4, 0.0], [-z1], [u, u], [u, u], [w]], None


EXPECTED = {"grpo": grpo_expected, "igpo": igpo_expected, "a2tgpo": a2tgpo_expected,
            "a2tgpo_release": a2tgpo_release_expected, "at2po": at2po_expected}


# --------------------------------------------------------------------------------------------
# the step


class _Tok:
    """What the step reads of a tokenizer: the pad id and decode (rollout records)."""

    pad_token_id = eos_token_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64))


def make_run(method_id: str, **settings) -> rl.Run:
    """A one-process run of the tiny model over the chosen trajectories' shapes."""
    method = METHODS[method_id]
    cfg = TrainConfig(run_dir="unused", results_dir="unused", method=method,
                      backbone=BackboneConfig(id="tiny", path="unused"), train_file="unused",
                      dev_file="unused", corpus="unused", device="cpu",
                      # one update over both questions, one micro-batch: one policy_loss call
                      schedule=ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=2,
                                              micro_batch_size=6), **settings)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return rl.Run(cfg=cfg, backend=SingleBackend(model, optimizer, 1.0),
                  placement=EnginePlacement(hosts_engine=True, group=0, n_groups=1,
                                            devices=(0,)),
                  optimizer=optimizer,
                  scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0),
                  ref=ReferencePolicy(model, "copy", "cpu") if method.loss.kl_coef > 0 else None,
                  tok=_Tok(), engine=HfEngine(model, _Tok()), tool=None, train_qs=[],
                  dev_qs=[], order=None, start=0)


def run_step(method_id: str, trajs: list[Trajectory], monkeypatch) -> list[dict]:
    """rl.train_step on `trajs` with the chosen gold probabilities; returns policy_loss's
    keyword arguments, one dict per call."""
    method = METHODS[method_id]
    run = make_run(method_id)
    model = run.backend.unwrapped

    def old_logprobs(run, batch, trajs, clock, *, seed):
        old = update.batched_logprobs(model, batch, list(range(len(trajs))), 6, "cpu")
        gold = gold_logprob_matrix([[math.log(p) for p in ps] for ps in GOLD_P])
        return old, gold if method.info_gain.enabled else None, {}

    captured = []
    real = update.policy_loss
    monkeypatch.setattr(rl, "sample_groups", lambda run, seed, clock: (
        trajs, {"gen_batches": 1, "retrieval_calls": 0, "obs_cut": 0.0}))
    monkeypatch.setattr(rl, "old_logprobs", old_logprobs)
    monkeypatch.setattr(update, "policy_loss",
                        lambda **kw: captured.append(kw) or real(**kw))
    rl.train_step(run, 0)
    return captured


@pytest.mark.parametrize("method_id", sorted(EXPECTED))
def test_train_step_gives_the_loss_the_hand_derived_advantages_and_bounds(method_id,
                                                                          monkeypatch):
    method = METHODS[method_id]
    trajs = TREES if method_id == "at2po" else CHAINS
    (call,) = run_step(method_id, trajs, monkeypatch)
    adv_rows, clip_rows = EXPECTED[method_id]()
    mask, turn_id = call["mask_BT"].bool(), call["turn_id_BT"]
    assert call["ratio_level"] == method.loss.ratio_level
    assert (call["clip_low"], call["clip_high"]) == (method.loss.clip_low, method.loss.clip_high)
    scale = call["clip_scale_BT"]
    assert (scale is None) == (clip_rows is None)
    for b, t in enumerate(trajs):
        row_turns = turn_id[b][mask[b]]
        # every sampled token of turn k, and only those, carries turn k's values
        assert row_turns.tolist() == [k for k in range(len(t.turns)) for _ in range(2)]
        want = torch.tensor(adv_rows[b])[row_turns]
        torch.testing.assert_close(call["adv_BT"][b][mask[b]].double(), want.double(),
                                   atol=1e-5, rtol=0, msg=f"{method_id} row {b}")
        assert (call["adv_BT"][b][~mask[b]] == 0).all()
        if scale is not None:
            c = torch.tensor(clip_rows[b], dtype=torch.float64)[row_turns]
            got = scale[b][mask[b]].double()
            # the bounds the loss applies: [1 − c·ε_low, 1 + c·ε_high]
            torch.testing.assert_close(1 - got * call["clip_low"], 1 - c * method.loss.clip_low,
                                       atol=1e-8, rtol=0, msg=f"{method_id} row {b} low")
            torch.testing.assert_close(1 + got * call["clip_high"],
                                       1 + c * method.loss.clip_high, atol=1e-8, rtol=0,
                                       msg=f"{method_id} row {b} high")


# --------------------------------------------------------------------------------------------
# settings refused before a job starts, and DAPO's filter metric


def _config(**kw):
    return TrainConfig(run_dir="r", results_dir="r", backbone=BackboneConfig(id="t", path="t"),
                       train_file="t", dev_file="d", corpus="c", **kw)


def test_a_reward_that_cannot_read_the_prompts_answers_is_refused():
    from dataclasses import replace

    from a2tgpo.rollout.agent import AgentConfig

    search_r1 = replace(METHODS["grpo"], reward="search_r1")
    _config(method=search_r1, rollout=AgentConfig(prompt_style="search_r1"))  # consistent
    with pytest.raises(ValueError, match="method.reward 'search_r1' scores search_r1 answers, "
                                         "but rollout.prompt_style 'a2tgpo'"):
        _config(method=search_r1)
    with pytest.raises(ValueError, match="scores a2tgpo answers"):
        _config(method=METHODS["grpo"], rollout=AgentConfig(prompt_style="search_r1"))


def test_zero_stage_3_is_refused_by_the_config():
    with pytest.raises(ValueError, match="zero_stage 3 is not supported"):
        _config(method=METHODS["grpo"], backend="deepspeed", zero_stage=3)


def test_old_logprobs_from_the_engine_are_the_sampled_ones_and_need_the_hf_engine():
    from a2tgpo.rollout.trajectory import collate

    batch = collate(CHAINS, 0)
    mask = batch.loss_mask.bool()
    old, _, _ = rl.old_logprobs(make_run("grpo", old_logprobs="engine"), batch, CHAINS,
                                rl.Clock(), seed=0)
    # every sampled token's engine log-prob is the chosen -0.5 (turn()); 0 elsewhere
    assert (old[mask] == -0.5).all() and (old[~mask] == 0).all()
    run = make_run("grpo")  # recompute: the tiny model's own log-probs, not the chosen ones
    recomputed, _, _ = rl.old_logprobs(run, batch, CHAINS, rl.Clock(), seed=0)
    assert (recomputed[mask] - -0.5).abs().min() > 1e-3
    with pytest.raises(ValueError, match="old_logprobs engine needs engine hf"):
        _config(method=METHODS["grpo"], engine="vllm", old_logprobs="engine")


def test_a_partitioned_reference_needs_deepspeed_ranks():
    _config(method=METHODS["grpo"], backend="deepspeed", reference="zero3")  # consistent
    with pytest.raises(ValueError, match="reference zero3_offload .* needs backend deepspeed"):
        _config(method=METHODS["grpo"], reference="zero3_offload")


def test_filter_metric_picks_the_value_whose_spread_keeps_a_group():
    from dataclasses import replace

    from a2tgpo.algo.advantages import dynamic_sampling_keep

    # group g: EM 1, 1 (no spread) but rewards 1 and 0.5 after the overlong penalty −0.5
    # (score, the reward before shaping, is 1 for both); group h: EM 0 and 1
    base = CHAINS[0]
    trajs = [replace(base, group_id="g", reward=1.0, extra={"em": 1.0, "score": 1.0}),
             replace(base, group_id="g", reward=0.5, extra={"em": 1.0, "score": 1.0}),
             replace(base, group_id="h", reward=-1.0, extra={"em": 0.0, "score": -1.0}),
             replace(base, group_id="h", reward=1.0, extra={"em": 1.0, "score": 1.0})]
    groups = [t.group_id for t in trajs]
    keep = {m: dynamic_sampling_keep(metric_B=rl.filter_metric(trajs, m), group_B=groups).tolist()
            for m in ("acc", "score", "seq_reward", "seq_final_reward")}
    assert keep["acc"] == keep["score"] == [False, False, True, True]
    assert keep["seq_reward"] == keep["seq_final_reward"] == [True] * 4
    with pytest.raises(ValueError, match="filter_metric"):
        rl.filter_metric(trajs, "nope")


def test_overlong_shaping_keeps_the_score_before_it():
    from dataclasses import replace

    from a2tgpo.algo.methods import DapoConfig
    from a2tgpo.rollout.agent import AgentConfig

    # b3's response: search turn (2 sampled + 1 observation) + answer (2) = 5 tokens; max 6,
    # buffer 2: penalty −(5 − (6 − 2))/2 · 1 = −0.5, so reward 1 -> 0.5, score stays 1
    cfg = _config(method=replace(METHODS["dapo"], dapo=DapoConfig(overlong_buffer=2)),
                  rollout=AgentConfig(max_response_tokens=6, max_turn_tokens=5))
    (t,) = rl.shape_rewards(cfg, [CHAINS[3]])
    assert (t.reward, t.extra["score"]) == (0.5, 1.0)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    from a2tgpo.rollout.trajectory import collate

    batch = collate(CHAINS, 0)
    rows = list(range(len(CHAINS)))
    out = {}
    for ckpt in (False, True):
        model = tiny_model()  # the same seeded weights both times
        if ckpt:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        assert model.is_gradient_checkpointing == ckpt
        with torch.no_grad():
            old = update.batched_logprobs(model, batch, rows, 6, "cpu") - 0.05
        data = update.UpdateBatch(batch, old, torch.ones_like(old) * batch.loss_mask)
        loss, _, _ = update.micro_batch_loss(
            model, data, rows, batch.loss_mask, METHODS["grpo"].loss, tokens=float(
                batch.loss_mask.sum()), seqs=6.0, world=1, norm_length=100, device="cpu")
        out[ckpt] = (loss.detach(), torch.autograd.grad(loss, list(model.parameters())))
    torch.testing.assert_close(out[True][0], out[False][0], atol=1e-6, rtol=0)
    for a, b in zip(out[True][1], out[False][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------
# micro-batches


def test_micro_batches_by_rows_and_by_token_budget():
    lengths = {0: 10, 1: 50, 2: 20, 3: 40, 4: 30, 5: 60, 6: 5}
    rows = [0, 1, 2, 3, 4, 5, 6]
    # by rows: rank r takes rows r::2 in order, 2 per micro-batch (2 calls on each rank)
    by_rows = update.micro_batches(lengths, rows, 2, max_rows=2)
    assert by_rows == [[[0, 2], [4, 6]], [[1, 3], [5]]]
    # budget 100, longest first: 5(60) 1(50) 3(40) 4(30) 2(20) 0(10) 6(5), dealt in turn:
    #   rank 0 gets 5, 3, 2, 6: [5] (2·60 > 100), [3, 2] (2·40 = 80; 3·40 > 100), [6]
    #   rank 1 gets 1, 4, 0:    [1, 4] (2·50 = 100), [0] (3·50 > 100), then an empty one
    by_tokens = update.micro_batches(lengths, rows, 2, max_rows=2, max_tokens=100)
    assert by_tokens == [[[5], [3, 2], [6]], [[1, 4], [0], []]]
    assert sorted(b for rank in by_tokens for mb in rank for b in mb) == rows
    # a row longer than the budget goes alone
    assert update.micro_batches({0: 300, 1: 10}, [0, 1], 1, max_rows=8, max_tokens=100) == \
        [[[0], [1]]]


class _GradBackend(SingleBackend):
    """SingleBackend that keeps the gradients of the update it steps."""

    def step(self) -> float:
        self.grads = [None if p.grad is None else p.grad.clone()
                      for p in self._model.parameters()]
        return super().step()


def test_token_budget_micro_batches_give_the_unsplit_loss_and_gradients():
    from a2tgpo.rollout.trajectory import collate

    batch = collate(CHAINS, 0)  # rows of 4 to 13 tokens
    rows = list(range(len(CHAINS)))
    got = {}
    # 2 rows per micro-batch; a 24-token budget (1-3 rows each); one micro-batch of all 6
    for budget in (0, 24, 10**6):
        model = tiny_model()
        with torch.no_grad():
            old = update.batched_logprobs(model, batch, rows, 6, "cpu") - 0.05
        adv = torch.linspace(-1, 1, old.numel()).view_as(old) * batch.loss_mask
        data = update.UpdateBatch(batch, old, adv, clip_scale=torch.full_like(old, 1.1))
        backend = _GradBackend(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0)
        log = update.UpdateLog()
        update.update_mini_batch(backend, data, rows, METHODS["a2tgpo"].loss,
                                 micro_batch_size=2, micro_batch_tokens=budget,
                                 norm_length=100, log=log)
        got[budget] = (sum(log.terms["total"]), backend.grads)
    loss0, grads0 = got[0]
    for budget in (24, 10**6):
        loss, grads = got[budget]
        assert abs(loss - loss0) < 1e-6, (budget, loss, loss0)
        for a, b in zip(grads, grads0, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_non_finite_gradient_norm_skips_the_update():
    # one weight, AdamW: a finite gradient moves it; a NaN gradient leaves it (and the
    # optimizer's step count) as it was, and the NaN norm is reported to the trainer
    w = torch.nn.Linear(1, 1, bias=False)
    opt = torch.optim.AdamW(w.parameters(), lr=0.1)
    backend = SingleBackend(w, opt, 1.0)
    w.weight.grad = torch.ones_like(w.weight)
    before = w.weight.detach().clone()
    assert backend.step() == 1.0 and not torch.equal(w.weight, before)
    before = w.weight.detach().clone()
    w.weight.grad = torch.full_like(w.weight, float("nan"))
    assert math.isnan(backend.step())
    assert torch.equal(w.weight, before) and w.weight.grad is None
    assert opt.state[w.weight]["step"] == 1


def test_the_later_updates_of_a_step_report_their_own_clip_fraction():
    """The first update of a step is on-policy (every ratio 1), so nothing clips there whatever
    the bounds: only the updates after it show whether the clip, and hence β, acts."""
    from a2tgpo.rollout.trajectory import collate

    batch = collate(CHAINS, 0)  # questions q1 and q2: two mini-batches of one prompt each
    rows = list(range(len(CHAINS)))
    model = tiny_model()
    with torch.no_grad():
        old = update.batched_logprobs(model, batch, rows, 6, "cpu")  # π_old = π: on-policy
    # A = +1 on every sampled token: the first update raises their probabilities, by enough at
    # this learning rate that the second one meets ratios above 1 + ε (mean ratio 1.21 there)
    data = update.UpdateBatch(batch, old, torch.ones_like(old) * batch.loss_mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    log = update.update_policy(
        SingleBackend(model, opt, 0.0), torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0),
        data, METHODS["grpo"].loss,
        ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=1, micro_batch_size=6),
        seed=0, norm_length=100)
    m = log.metrics()
    assert len(log.grad_norms) == 2 and 0 < m["clip/later"] < 1
    # one micro-batch per update: the all-update mean is (0 + the second's) / 2
    assert m["loss/pg_clipfrac"] == pytest.approx(m["clip/later"] / 2, rel=1e-6)
    # by turn: a turn both questions have (0, 1) is 0 in the first update, and its later value
    assert m["clip/later/by_turn/0"] > 0
    for k in (0, 1):
        first, second = log.clip_by_turn[k]
        assert first == 0 and [second] == log.clip_by_turn_later[k]
        assert m[f"clip/later/by_turn/{k}"] == second


def test_a_shared_prompt_run_once_gives_the_same_log_probs_loss_and_gradients():
    from a2tgpo.rollout.trajectory import collate

    batch = collate(CHAINS, 0)
    rows = list(range(len(CHAINS)))
    # every row starts 1 2 | 10 20 (prompt, then turn 0's two tokens); b5 ends there (4 tokens),
    # so 3 columns are shared: each row keeps at least its last token for itself
    assert update.common_prefix(batch.input_ids, batch.attention_mask) == 3
    assert update.common_prefix(batch.input_ids[:1], batch.attention_mask[:1]) == 0
    got = {}
    for share in (False, True):
        model = tiny_model()
        with torch.no_grad():
            lp = update.batched_logprobs(model, batch, rows, 6, "cpu", share_prefix=share)
        old = lp - 0.05
        adv = torch.linspace(-1, 1, old.numel()).view_as(old) * batch.loss_mask
        data = update.UpdateBatch(batch, old, adv, clip_scale=torch.full_like(old, 1.1))
        backend = _GradBackend(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0)
        log = update.UpdateLog()
        update.update_mini_batch(backend, data, rows, METHODS["a2tgpo"].loss,
                                 micro_batch_size=6, norm_length=100, log=log,
                                 share_prefix=share)
        got[share] = (lp, sum(log.terms["total"]), backend.grads)
    (lp0, loss0, grads0), (lp1, loss1, grads1) = got[False], got[True]
    mask = batch.attention_mask.bool()
    torch.testing.assert_close(lp1[mask], lp0[mask], atol=1e-5, rtol=0)
    assert abs(loss1 - loss0) < 1e-6
    for a, b in zip(grads1, grads0, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
