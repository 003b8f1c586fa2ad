"""What computing log π_old through the update's own path costs an IG method, and what it buys
in bf16.

Before, an IG method took log π_old from the fused IG pass (`score_gold_logprobs(...,
token_logprobs=True)`: one trajectory forward with a KV cache, padded batches of
ig_batch_size, whose hidden states give the token log-probs, then the probe forward). Now the
IG pass runs without the token log-probs (`token_logprobs=False`) and log π_old comes from
`update.update_logprobs` (the update's mini-batches and micro-batches, no gradients): one more
decoder forward over the batch. Printed, per dtype: seconds of each (median of --reps, after
one untimed warm-up), the ratio now / before, and the bf16 gap the change removes: per turn,
|mean over the turn's tokens of (log π_update − log π_old)|, p50 / p99 / share above
A2TGPO's ε_low = 3e-3, for the fused pass's log-probs and for `update_logprobs`' (the latter
must be exactly 0: it is what the update's first forward recomputes, checked here by running
that forward with gradients, as `micro_batch_loss` does).

The model is a random Qwen3-architecture one (--hidden, --layers, vocabulary 4096) whose output
layer is scaled to logits of a trained model's spread (std ~5; gpu-path.md M3), with
trajectories of --turns turns sampled at random lengths (prompt 120 tokens shared by each
question's group, turns of 20-60 tokens, observations of 60-120), 4 questions x 4 rows, IG
probes of 12 tokens. Random weights are not a trained model: the gap is an order of magnitude;
the seconds are this machine's (CPU threads: --threads).

    python bench/old_logprob_cost.py [--hidden 256] [--layers 4] [--turns 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

VOCAB = 4096
EPS_LOW = 3e-3


def model_for(hidden: int, layers: int, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=False, attn_implementation="sdpa"))
    with torch.no_grad():
        h = torch.randn(256, hidden)
        logits = model.lm_head(model.model.norm(h))
        model.lm_head.weight.mul_(5.0 / float(logits.std()))
    return model.to(dtype).eval()


def trajectories(turns: int, seed: int = 0):
    from a2tgpo.rollout.trajectory import Trajectory, Turn

    rng = random.Random(seed)
    tok = lambda n: tuple(rng.randrange(2, VOCAB) for _ in range(n))  # noqa: E731
    out = []
    for q in range(4):
        prompt = tok(120)
        for _ in range(4):
            ts = []
            for _ in range(rng.randint(1, turns)):
                action = tok(rng.randint(20, 60))
                ts.append(Turn(action, (0.0,) * len(action), tok(rng.randint(60, 120)),
                               "search"))
            ts[-1] = Turn(ts[-1].action_ids, ts[-1].action_logprobs, (), "answer")
            out.append(Trajectory(prompt, tuple(ts), f"q{q}", f"q{q}", ("x",), reward=0.0))
    return out


def per_turn_gap(batch, a_BL, b_BL) -> torch.Tensor:
    """|mean over each turn's sampled tokens of (a − b)| for every turn of every row."""
    d = (a_BL - b_BL).double() * batch.loss_mask
    out = []
    for b in range(d.shape[0]):
        for k in range(int(batch.num_turns[b])):
            sel = (batch.turn_id[b] == k) & batch.loss_mask[b].bool()
            out.append(float(d[b][sel].mean().abs()))
    return torch.tensor(out)


def first_forward(model, batch, schedule, seed):
    """log π of every token as the update's first forwards compute it (with gradients)."""
    from a2tgpo.train.update import micro_batches, mini_batch_rows, row_length, token_logprobs

    out = torch.zeros(batch.input_ids.shape)
    lengths = dict(enumerate(batch.attention_mask.sum(1).tolist()))
    for rows in mini_batch_rows(batch.group_ids, schedule, seed)[0]:
        for mb in micro_batches(lengths, rows, 1, max_rows=schedule.micro_batch_size,
                                max_tokens=schedule.micro_batch_tokens)[0]:
            n = row_length(batch, mb)
            out[mb, :n] = token_logprobs(model, batch, mb, device="cpu", length=n,
                                         share_prefix=schedule.share_prompt)[0].detach()
    return out


def planned_tokens(batch, schedule, seed) -> int:
    """rows x length of every micro-batch `update_logprobs` runs (padding included)."""
    from a2tgpo.train.update import micro_batches, mini_batch_rows, row_length

    lengths = dict(enumerate(batch.attention_mask.sum(1).tolist()))
    return sum(len(mb) * row_length(batch, mb)
               for rows in mini_batch_rows(batch.group_ids, schedule, seed)[0]
               for mb in micro_batches(lengths, rows, 1, max_rows=schedule.micro_batch_size,
                                       max_tokens=schedule.micro_batch_tokens)[0])


def timed(fn, reps: int):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048, help="micro_batch_tokens")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from a2tgpo.rollout.info_gain import score_gold_logprobs
    from a2tgpo.rollout.trajectory import collate
    from a2tgpo.train.config import ScheduleConfig
    from a2tgpo.train.distributed import SingleBackend
    from a2tgpo.train.update import update_logprobs

    trajs = trajectories(args.turns)
    batch = collate(trajs, 0)
    inputs = [(t.token_ids(), t.probe_points()) for t in trajs]
    probes = [(list(range(10, 22)), (4, 8))] * len(trajs)
    schedule = ScheduleConfig(steps=1, prompts_per_step=4, mini_batch_prompts=2,
                              micro_batch_size=16, micro_batch_tokens=args.budget)
    print(f"{len(trajs)} trajectories, {int(batch.attention_mask.sum())} tokens "
          f"(longest {batch.input_ids.shape[1]}), Qwen3 hidden {args.hidden} x {args.layers} "
          f"layers, micro_batch_tokens {args.budget}, ig_batch_size 16, "
          f"{torch.get_num_threads()} thread(s)")
    ig = score_gold_logprobs(model_for(64, 1, torch.float32), inputs, probes, batch_size=16,
                             token_logprobs=False)[2]
    extra = planned_tokens(batch, schedule, seed=0)
    ratio = (ig["padded_tokens"] + extra) / ig["padded_tokens"]
    print(f"forward tokens, padding included: the IG pass {ig['padded_tokens']} (its "
          f"trajectory forward and its probe forward), update_logprobs {extra} (the batch's "
          f"{ig['trajectory_tokens']} tokens in micro-batches): now / before x{ratio:.2f}")
    for dtype in (torch.float32, torch.bfloat16):
        model = model_for(args.hidden, args.layers, dtype)
        backend = SingleBackend(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0)

        def before(model=model):
            return score_gold_logprobs(model, inputs, probes, batch_size=16,
                                       token_logprobs=True)

        def now(model=model, backend=backend):
            score_gold_logprobs(model, inputs, probes, batch_size=16, token_logprobs=False)
            return update_logprobs(backend, batch, schedule, seed=0)[1]

        (_, lps, _), t_before = timed(before, args.reps)
        old_now, t_now = timed(now, args.reps)
        fused = torch.zeros(batch.input_ids.shape)
        for b, lp in enumerate(lps):
            fused[b, 1: 1 + len(lp)] = torch.tensor(lp)
        model.train()
        first = first_forward(model, batch, schedule, seed=0)
        model.eval()
        name = str(dtype).removeprefix("torch.")
        print(f"{name}: before (fused IG + old) {t_before:.2f} s, now (IG without token "
              f"log-probs + update_logprobs) {t_now:.2f} s: x{t_now / t_before:.2f}")
        for label, old in (("fused pass", fused), ("update_logprobs", old_now)):
            gap = per_turn_gap(batch, first, old)
            print(f"  {name} first update vs {label}: per-turn |mean dlogp| p50 "
                  f"{gap.median():.2e} p99 {gap.quantile(0.99):.2e} max {gap.max():.2e}, "
                  f"{float((gap > EPS_LOW).float().mean()):.0%} of {len(gap)} turns above "
                  f"eps_low {EPS_LOW}")


if __name__ == "__main__":
    main()
