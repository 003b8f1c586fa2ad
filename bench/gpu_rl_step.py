"""One RL step of a Qwen3-0.6B-architecture model (random weights built from its config, bf16)
on one GPU, through the trainer's own functions, with the hf engine. Prints one table:

  rollout      hf engine sampling of prompts x n continuations: tokens/s
  old / IG     the old-logprob pass alone (`update.batched_logprobs`) and the fused IG +
               old-logprob pass (`rollout.info_gain.score_gold_logprobs`): seconds, ratio
  update       `rl.token_advantages` + `update.update_policy` (A2TGPO's loss): tokens/s
  memory       peak GPU memory of the step

Needs only torch and transformers (the lent GPU machine has no vLLM, DeepSpeed or faiss), so
the agent loop's searches are stood in for: each continuation is cut into tool-call turns
with random observation tokens between them, which gives the IG pass its probe points.

    python3 bench/gpu_rl_step.py            # on a GPU (bench/gpu_check.sh runs it)
    python3 bench/gpu_rl_step.py --tiny     # a CPU smoke run of the same code
"""

from __future__ import annotations

import argparse
import time

import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.rollout.engine import SamplingParams
from a2tgpo.rollout.hf_engine import HfEngine
from a2tgpo.rollout.info_gain import gold_logprob_matrix, score_gold_logprobs
from a2tgpo.rollout.trajectory import Trajectory, Turn, collate
from a2tgpo.train.config import ScheduleConfig
from a2tgpo.train.distributed import SingleBackend
from a2tgpo.train.rl import token_advantages
from a2tgpo.train.update import UpdateBatch, batched_logprobs, update_policy

# Qwen3-0.6B (config.json of Qwen/Qwen3-0.6B): the architecture, without weights files
QWEN3_0_6B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, rms_norm_eps=1e-6)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


class _Tok:
    """What the engine and the step read of a tokenizer (no stop strings are used)."""

    pad_token_id = 0
    eos_token_id = -1

    def decode(self, ids, **kw):
        return ""


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def build(tiny: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(QWEN3_0_6B)
    if tiny:
        cfg.update(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen3ForCausalLM(Qwen3Config(**cfg, attn_implementation="sdpa"))
    return model.to(torch.bfloat16 if DEV == "cuda" else torch.float32)


def trajectories(gens, prompts, *, groups: int, turns: int, obs: int, vocab: int):
    """Each continuation cut into `turns` tool-call turns plus a final one, `obs` random
    observation ids after each call; group = prompt."""
    g = torch.Generator().manual_seed(2)
    out = []
    for i, (gen, prompt) in enumerate(zip(gens, prompts, strict=True)):
        ids, lps = list(gen.token_ids), list(gen.logprobs)
        cut = max(1, len(ids) // (turns + 1))
        parts = []
        for k in range(turns + 1):
            a, b = k * cut, (len(ids) if k == turns else (k + 1) * cut)
            if a >= b:
                break
            final = k == turns or b == len(ids)
            o = () if final else tuple(torch.randint(1, vocab, (obs,), generator=g).tolist())
            parts.append(Turn(tuple(ids[a:b]), tuple(lps[a:b]), o,
                              "answer" if final else "search", entropy=0.5))
            if final:
                break
        out.append(Trajectory(tuple(prompt), tuple(parts), f"q{i % groups}", i % groups,
                              ("gold",), reward=float(i % 3 == 0),
                              extra={"em": 0.0, "f1": 0.0, "format_ok": True}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a small model on CPU (smoke run)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--new-tokens", type=int, default=512)
    args = ap.parse_args()
    if args.tiny:
        args.prompts, args.n, args.new_tokens = 2, 4, 32
    model = build(args.tiny)
    vocab = model.config.vocab_size
    B = args.prompts * args.n
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (300 if not args.tiny else 20,), generator=g).tolist()
               for _ in range(args.prompts) for _ in range(args.n)]
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()

    engine = HfEngine(model.eval(), _Tok(), eos_token_ids=[-1], max_batch=B)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2), seeds=[0, 1])  # warm-up
    gens, t_roll = timed(lambda: engine.generate(
        prompts, SamplingParams(max_tokens=args.new_tokens), seeds=list(range(B))))
    sampled = sum(len(x.token_ids) for x in gens)
    trajs = trajectories(gens, prompts, groups=args.prompts, turns=3,
                         obs=100 if not args.tiny else 8, vocab=vocab)
    batch = collate(trajs, 0)
    rows = list(range(B))

    probe = (torch.randint(1, vocab, (20,), generator=g).tolist(), (12, 16))
    inputs = [(t.token_ids(), t.probe_points()) for t in trajs]
    batched_logprobs(model, batch, rows[:2], 2, DEV)  # warm both passes on first use
    score_gold_logprobs(model, inputs[:2], [probe] * 2, batch_size=2)
    old, t_old = timed(lambda: batched_logprobs(model, batch, rows, 8, DEV))
    (values, _, _), t_ig = timed(lambda: score_gold_logprobs(
        model, inputs, [probe] * B, batch_size=8, token_logprobs=True))

    method = METHODS["a2tgpo"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    backend = SingleBackend(model, opt, 1.0)
    sched = ScheduleConfig(steps=1, prompts_per_step=args.prompts,
                           mini_batch_prompts=max(1, args.prompts // 8) if not args.tiny else 1,
                           micro_batch_size=4)

    def step():
        adv = token_advantages(method, batch, trajs, gold_logprob_matrix(values), _Tok())
        data = UpdateBatch(batch, old, adv.adv_BL, None, adv.clip_BL)
        return update_policy(backend, torch.optim.lr_scheduler.LambdaLR(opt, lambda u: 1.0),
                             data, method.loss, sched, seed=0, norm_length=6192)

    _, t_upd = timed(step)
    tokens = int(batch.attention_mask.sum())
    peak = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")
    rows_out = [
        ("device", torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (--tiny)"),
        ("model", "Qwen3-0.6B architecture" if not args.tiny else "tiny Qwen3"),
        ("trajectories x tokens (padded)", f"{B} x {batch.input_ids.shape[1]}"),
        ("rollout tokens/s (hf engine)", f"{sampled / t_roll:,.0f}"),
        ("old-logprob pass s", f"{t_old:.3f}"),
        ("IG + old-logprob pass s", f"{t_ig:.3f}"),
        ("IG extra time / old-logprob time", f"{(t_ig - t_old) / t_old:.2f}"),
        ("update tokens/s (A2TGPO loss)", f"{tokens / t_upd:,.0f}"),
        ("peak GPU memory GiB", f"{peak:.1f}"),
    ]
    width = max(len(k) for k, _ in rows_out)
    for k, v in rows_out:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
