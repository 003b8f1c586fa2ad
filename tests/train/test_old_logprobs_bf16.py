"""In bf16 the first update of a step is on-policy: every ratio exactly 1.

log π_old is computed through the update's own path (the same module, rows grouped into the
same mini-batches and micro-batches, cut to the same length, no gradients), so the update's
first forward recomputes exactly the numbers it is compared with. A pass that groups the rows
otherwise (the fused IG pass, 16-row batches padded to their longest; a plain pass with its own
micro-batches) differs in bf16 by far more than A2TGPO's ε = 3e-3 around ratio 1: a bf16 matmul
rounds its output to 8 bits of mantissa (relative 2^-9 ≈ 2e-3 per element), and which rounding
an element gets depends on the kernel's blocking, i.e. on the batch and padded length.

The model: a random one-layer Qwen3 in bf16 whose output layer is scaled so that its logits
have the spread of a trained model's (std ~ 5 here): log-softmax then magnifies the hidden
states' rounding into log-prob differences of 1e-2, as gpu-path.md M3 measured on CPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.rollout.hf_engine import HfEngine
from a2tgpo.rollout.trajectory import Trajectory, Turn
from a2tgpo.train import rl, update
from a2tgpo.train.config import ScheduleConfig, TrainConfig
from a2tgpo.train.distributed import EnginePlacement, SingleBackend

VOCAB = 64


class CharTok:
    """One token per character (ids 2..61), offsets included: what `build_probe` reads."""

    pad_token_id = eos_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {"input_ids": [2 + ord(c) % 60 for c in text],
                "offset_mapping": [(i, i + 1) for i in range(len(text))]}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def bf16_model(logit_scale: float):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="sdpa"))
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model.to(torch.bfloat16).eval()


def trajectories(questions: int = 2, seed: int = 0) -> list[Trajectory]:
    """`questions` x 4 trajectories of 1-4 turns, 12-70 tokens: rows of many lengths."""
    rng = random.Random(seed)
    out = []
    for q in (f"q{i}" for i in range(questions)):
        prompt = tuple(rng.randrange(2, VOCAB) for _ in range(8))
        for i in range(4):
            n_turns = rng.randint(1, 4)
            turns = []
            for k in range(n_turns):
                last = k == n_turns - 1
                ids = tuple(rng.randrange(2, VOCAB) for _ in range(rng.randint(2, 9)))
                obs = () if last else tuple(rng.randrange(2, VOCAB)
                                            for _ in range(rng.randint(3, 8)))
                turns.append(Turn(ids, (-1.0,) * len(ids), obs,
                                  "answer" if last else "search", entropy=0.5))
            out.append(Trajectory(prompt, tuple(turns), q, q, ("Paris",),
                                  reward=float(i % 2), extra={"em": float(i % 2), "f1": 0.0,
                                                              "format_ok": True}))
    return out


class CountingBackend(SingleBackend):
    """SingleBackend that counts its optimizer steps."""

    steps = 0

    def step(self) -> float:
        self.steps += 1
        return super().step()


def make_run(method_id: str, model, schedule: ScheduleConfig, lr: float) -> rl.Run:
    cfg = TrainConfig(run_dir="unused", results_dir="unused", method=METHODS[method_id],
                      backbone=BackboneConfig(id="tiny", path="unused"), train_file="unused",
                      dev_file="unused", corpus="unused", device="cpu", schedule=schedule,
                      ig_batch_size=16)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return rl.Run(cfg=cfg, backend=CountingBackend(model, optimizer, 1.0),
                  placement=EnginePlacement(hosts_engine=True, group=0, n_groups=1,
                                            devices=(0,)),
                  optimizer=optimizer,
                  scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1.0),
                  ref=None, tok=CharTok(), engine=HfEngine(model, CharTok()), tool=None,
                  train_qs=[], dev_qs=[], order=None, start=0)


def update_calls(method_id: str, schedule: ScheduleConfig, monkeypatch, *, lr: float = 1e-2,
                 logit_scale: float = 10.0, checkpointing: bool = False
                 ) -> list[tuple[int, dict, dict]]:
    """rl.train_step on `schedule.prompts_per_step` questions' trajectories; per policy_loss
    call (one per micro-batch): the number of optimizer steps before it, its keyword arguments
    and its diagnostics."""
    trajs = trajectories(schedule.prompts_per_step)
    model = bf16_model(logit_scale)
    if checkpointing:  # as train.gradient_checkpointing sets it (config/paper.yaml)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    run = make_run(method_id, model, schedule, lr)
    calls = []
    real = update.policy_loss

    def spy(**kw):
        loss, diag = real(**kw)
        calls.append((run.backend.steps, kw, diag))
        return loss, diag

    monkeypatch.setattr(rl, "sample_groups", lambda run, seed, clock: (
        trajs, {"gen_batches": 1, "retrieval_calls": 0, "obs_cut": 0.0}))
    monkeypatch.setattr(update, "policy_loss", spy)
    rl.train_step(run, 0)
    return calls


def assert_on_policy(kw: dict, diag: dict) -> None:
    mask = kw["mask_BT"].bool()
    assert mask.any()
    # every token's log-ratio is exactly 0, hence every turn's / sequence's ratio 1
    assert torch.equal(kw["logp_BT"].detach()[mask], kw["old_logp_BT"][mask])
    assert float(diag["pg_clipfrac"]) == 0.0 and float(diag["ratio_mean"]) == 1.0


# rows 3: the first mini-batch's 4 rows go into micro-batches [3 rows, 1 row]; tokens 60: longest
# first, packed under 60 padded tokens (1-3 rows each); the IG pass runs all 8 rows as one batch
ROWS_3 = dict(micro_batch_size=3)
TOKENS_60 = dict(micro_batch_size=8, micro_batch_tokens=60)
SHARED = dict(micro_batch_size=3, share_prompt=True)  # the 3 rows' common prompt run once


@pytest.mark.parametrize(("method_id", "split"), [
    ("a2tgpo", ROWS_3), ("a2tgpo", TOKENS_60), ("a2tgpo", SHARED),  # IG: from the IG pass before
    ("at2po_entropy_atpo", ROWS_3),  # turn ratio without IG: the plain old pass before
    ("gspo", ROWS_3),  # sequence ratio, ε = 3e-4
])
def test_first_update_ratios_are_exactly_one_in_bf16(method_id, split, monkeypatch):
    """Before the change (log π_old from the fused IG pass / the plain pass over rows
    rank::world) every case here failed: one micro-batch of the first update had
    max |log π − log π_old| = 1.13e-2, ratio_mean 1.0033 and pg_clipfrac 0.75 (gspo: 1.0)."""
    schedule = ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=1, **split)
    first = [(kw, diag) for steps, kw, diag in update_calls(method_id, schedule, monkeypatch)
             if steps == 0]
    assert len(first) >= 2  # the first mini-batch's rows went into several micro-batches
    for kw, diag in first:
        assert_on_policy(kw, diag)


def test_gradient_checkpointing_keeps_the_first_update_on_policy(monkeypatch):
    """The update recomputes each layer in backward; its forward values are the old pass's."""
    schedule = ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=1, **TOKENS_60)
    calls = update_calls("a2tgpo", schedule, monkeypatch, checkpointing=True)
    for _, kw, diag in [c for c in calls if c[0] == 0]:
        assert_on_policy(kw, diag)


@pytest.mark.parametrize(("questions", "per_update"), [(2, 1), (4, 2)])
def test_every_update_of_the_first_epoch_meets_its_own_grouping(questions, per_update,
                                                                monkeypatch):
    """Learning rate 0: the policy never moves, so every update of the step is on-policy, and
    with log π_old grouped as each mini-batch is, each one's ratios are exactly 1 (the later
    mini-batches' grouping matters as much as the first's). 4 questions, 2 per update: which
    pairs share an update is the step seed's shuffle, so the old pass must use it."""
    schedule = ScheduleConfig(steps=1, prompts_per_step=questions,
                              mini_batch_prompts=per_update, **TOKENS_60)
    calls = update_calls("a2tgpo", schedule, monkeypatch, lr=0.0)
    assert {steps for steps, _, _ in calls} == {0, 1}  # two updates, both checked
    for _, kw, diag in calls:
        assert_on_policy(kw, diag)
