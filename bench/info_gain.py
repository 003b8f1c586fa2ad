"""Information-gain scorer benchmark: KV reuse (ours) vs one re-forward per prefix (naive).

On a seeded random Qwen3-architecture model (performance.md §1.4 sizes: hidden 256, 4 layers,
4/2 heads, vocab 4096, fp32) and trajectories shaped like §1.3 (prompt 300 tokens; each search
turn 150 generated + 400 observation tokens; a final turn of 550 as in §1.3's L; probe of 20
tokens with a 5-token answer), one trajectory per search count 1..6, it prints:

  IG extra tokens / trajectory tokens, for ours and naive;
  IG time / old-logprob forward time on the same trajectories, where the old-logprob forward is
    a plain forward + log-softmax (what the trainer runs anyway); ours fuses IG into that
    forward, so its IG time is (fused time − plain time); naive's is all of its time;
  max |Δ| between the two methods' values, and of the fused per-token log-probs vs the plain
    forward's.

Times are process CPU time, best of --repeat, with torch threads fixed (wall time on a shared
VM varies ~3x, §1.4). Done-when targets: ours <= 0.05 extra-token ratio and <= 0.15 time ratio.

Usage: .venv/bin/python bench/info_gain.py [--scale 1.0] [--repeat 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from a2tgpo.rollout.info_gain import score_gold_logprobs


def build_model(hidden: int, layers: int, vocab: int, max_len: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, max_position_embeddings=max_len,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


def build_batch(scale: float, vocab: int, max_calls: int, seed: int):
    """One trajectory per search count 1..max_calls, with probe points after the prompt and
    after each observation, and a 20-token probe per trajectory."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()  # noqa: E731
    prompt, gen, obs = (round(scale * n) for n in (300, 150, 400))
    trajs, probes = [], []
    for calls in range(1, max_calls + 1):
        ids = rand(prompt)
        points = [len(ids)]
        for _ in range(calls):
            ids += rand(gen) + rand(obs)
            points.append(len(ids))
        ids += rand(gen + obs)
        trajs.append((ids, points))
        probes.append((rand(20), (14, 19)))
    return trajs, probes


def plain_old_logprobs(model, trajs, batch_size: int) -> list[list[float]]:
    """The trainer's old-logprob pass without IG: right-padded forward, log-softmax, gather."""
    out = []
    for lo in range(0, len(trajs), batch_size):
        rows = [ids for ids, _ in trajs[lo: lo + batch_size]]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
            lp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        out += [lp[i, : len(r) - 1].tolist() for i, r in enumerate(rows)]
    return out


def cpu_time(fn, repeat: int):
    """(best process CPU seconds over `repeat` runs, last result)."""
    best, result = float("inf"), None
    for _ in range(repeat):
        t = time.process_time()
        result = fn()
        best = min(best, time.process_time() - t)
    return best, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply all segment lengths")
    ap.add_argument("--max-calls", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=1,
                    help="trajectories (naive: prefix sequences) per forward; 1 = no padding")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    trajs, probes = build_batch(args.scale, args.vocab, args.max_calls, args.seed)
    max_len = max(len(ids) for ids, _ in trajs) + 64
    model = build_model(args.hidden, args.layers, args.vocab, max_len, args.seed)
    bs = args.batch_size
    plain_lp = plain_old_logprobs(model, trajs[:1], bs)  # warm-up (allocator, kernels)

    t_plain, plain_lp = cpu_time(lambda: plain_old_logprobs(model, trajs, bs), args.repeat)
    t_kv, (kv, kv_lp, kv_stats) = cpu_time(
        lambda: score_gold_logprobs(model, trajs, probes, method="kv", batch_size=bs),
        args.repeat)
    t_naive, (naive, _, naive_stats) = cpu_time(
        lambda: score_gold_logprobs(model, trajs, probes, method="naive", batch_size=bs),
        args.repeat)

    L = kv_stats["trajectory_tokens"]
    dv = max(abs(a - b) for ra, rb in zip(kv, naive, strict=True)
             for a, b in zip(ra, rb, strict=True))
    dlp = max(abs(a - b) for ra, rb in zip(kv_lp, plain_lp, strict=True)
              for a, b in zip(ra, rb, strict=True))
    report = {
        "setup": {"trajectories": len(trajs), "lengths": [len(ids) for ids, _ in trajs],
                  "probe_points": kv_stats["probe_points"], "probe_tokens": 20,
                  "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "batch_size": bs, "threads": args.threads, "repeat": args.repeat},
        "trajectory_tokens": L,
        "ig_tokens": {"ours": kv_stats["ig_tokens"], "naive": naive_stats["ig_tokens"]},
        "ig_token_ratio": {"ours": kv_stats["ig_tokens"] / L,
                           "naive": naive_stats["ig_tokens"] / L},
        "cpu_s": {"old_logprob_plain": t_plain, "ours_fused": t_kv, "naive": t_naive},
        "ig_time_ratio": {"ours": (t_kv - t_plain) / t_plain, "naive": t_naive / t_plain},
        "max_abs_diff": {"values_ours_vs_naive": dv, "token_logprobs_fused_vs_plain": dlp},
    }
    report["targets_met"] = (report["ig_token_ratio"]["ours"] <= 0.05
                             and report["ig_time_ratio"]["ours"] <= 0.15)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
