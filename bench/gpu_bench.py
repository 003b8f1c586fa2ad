"""GPU benchmark for a machine that cannot download anything: Qwen3-4B built from its config
with random weights (bf16). Prints one table:

  1. hf engine decode tokens/s at batch 128 (KV cache, per-row seeds and stops);
  2. information-gain scorer time / old-logprob forward time on A2TGPO-shaped trajectories,
     and IG extra tokens / trajectory tokens (ours: KV reuse fused with that forward);
  3. one training step (forward + backward + AdamW) tokens/s and MFU on one GPU;
  4. flat top-3 inner-product search as a matmul over 2M random 768-d vectors (fp16), q/s.

Run: python3 bench/gpu_bench.py [--quick]   (bench/gpu_check.sh calls it)
"""

from __future__ import annotations

import argparse
import time

import torch

# Qwen3-4B (config.json of Qwen/Qwen3-4B): the architecture, built here without weights files
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                tie_word_embeddings=True, rms_norm_eps=1e-6)
H200_BF16_TFLOPS = 989.0  # dense bf16 peak (datasheet), for MFU
VOCAB_HI = QWEN3_4B["vocab_size"] - 1  # random token ids stay below this


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def build(tiny: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(QWEN3_4B)
    if tiny:  # a CPU smoke run of this script's code paths
        cfg.update(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    config = Qwen3Config(**cfg, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model, config


class ByteTok:
    """Enough of a tokenizer for the engine: decode ids for stop checks (no stops used)."""

    pad_token_id = 0
    eos_token_id = 151645

    def decode(self, ids, **kw):
        return ""


def bench_decode(model, batch: int, prompt: int, new: int) -> dict:
    from a2tgpo.rollout.engine import SamplingParams
    from a2tgpo.rollout.hf_engine import HfEngine

    model.generation_config.eos_token_id = [151645]
    eng = HfEngine(model.eval(), ByteTok(), eos_token_ids=[-1], max_batch=batch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1000, VOCAB_HI, (prompt,), generator=g).tolist() for _ in range(batch)]
    eng.generate(prompts[:4], SamplingParams(max_tokens=4), seeds=list(range(4)))  # warm-up
    sync()
    t = time.perf_counter()
    out = eng.generate(prompts, SamplingParams(max_tokens=new), seeds=list(range(batch)))
    sync()
    dt = time.perf_counter() - t
    toks = sum(len(o.token_ids) for o in out)
    return {"decode_tok_s": toks / dt, "decode_tokens": toks, "decode_s": dt}


def bench_ig(model, n_traj: int, searches: int) -> dict:
    from a2tgpo.rollout.info_gain import score_gold_logprobs

    g = torch.Generator().manual_seed(1)
    trajs, probes = [], []
    for b in range(n_traj):
        k = 1 + b % searches
        ids = torch.randint(1000, VOCAB_HI, (300 + 550 * k + 550,), generator=g).tolist()
        points = [300] + [300 + 550 * (t + 1) for t in range(k)]
        trajs.append((ids, points))
        probes.append((torch.randint(1000, VOCAB_HI, (20,), generator=g).tolist(), (12, 16)))
    model.eval()

    def fused():
        return score_gold_logprobs(model, trajs, probes, method="kv", batch_size=2)[2]

    def plain():  # the old-logprob forward alone over the same batches
        with torch.inference_mode():
            for s in range(0, n_traj, 2):
                rows = [trajs[i][0] for i in range(s, min(n_traj, s + 2))]
                L = max(len(r) for r in rows)
                ids = torch.zeros(len(rows), L, dtype=torch.long, device=DEV)
                attn = torch.zeros_like(ids)
                for i, r in enumerate(rows):
                    ids[i, : len(r)] = torch.tensor(r)
                    attn[i, : len(r)] = 1
                logits = model(input_ids=ids, attention_mask=attn).logits
                torch.log_softmax(logits.float(), -1)

    # warm both paths on the exact shapes first (kernel selection and allocator growth
    # happen on first use and must not be charged to either side), then best of 2
    fused(), plain()
    times = {"fused": [], "plain": []}
    for _ in range(2):
        for name, fn in (("fused", fused), ("plain", plain)):
            sync()
            t = time.perf_counter()
            out = fn()
            sync()
            times[name].append(time.perf_counter() - t)
            if name == "fused":
                stats = out
    fused_s, plain = min(times["fused"]), min(times["plain"])
    fused = fused_s
    return {"ig_time_ratio": (fused - plain) / plain, "ig_token_ratio":
            stats["ig_tokens"] / stats["trajectory_tokens"], "old_logprob_s": plain,
            "breakdown": {k: v for k, v in stats.items() if k.startswith("seconds")}}


def bench_train(model, config, batch: int, seq: int) -> dict:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=DEV == "cuda")
    ids = torch.randint(1000, VOCAB_HI, (batch, seq), device=DEV)
    n_params = sum(p.numel() for p in model.parameters())

    def step():
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1),
                                                 ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    sync()
    t = time.perf_counter()
    reps = 3
    for _ in range(reps):
        step()
    sync()
    dt = (time.perf_counter() - t) / reps
    tokens = batch * seq
    # 6N per token for the matmuls plus attention 12·layers·hidden·seq (causal half: 6·...)
    flops = tokens * (6 * n_params + 6 * config.num_hidden_layers * config.hidden_size * seq)
    return {"train_tok_s": tokens / dt, "train_step_s": dt,
            "mfu": flops / dt / (H200_BF16_TFLOPS * 1e12), "params": n_params}


def bench_search(n: int, dim: int, queries: int) -> dict:
    g = torch.Generator(device=DEV).manual_seed(0)
    index = torch.nn.functional.normalize(
        torch.randn(n, dim, device=DEV, dtype=torch.float16, generator=g), dim=-1)
    q = torch.nn.functional.normalize(
        torch.randn(queries, dim, device=DEV, dtype=torch.float16, generator=g), dim=-1)
    torch.topk(q[:8] @ index.T, 3)
    sync()
    t = time.perf_counter()
    for s in range(0, queries, 256):
        torch.topk(q[s: s + 256] @ index.T, 3, dim=-1)
    sync()
    dt = time.perf_counter() - t
    return {"search_q_s": queries / dt, "search_vectors": n}


def row(name: str, value: str) -> None:
    """Print a row as soon as it is measured (a later section may run out of memory)."""
    print(f"{name:<40}  {value}", flush=True)


def section(name: str, fn) -> None:
    """Run one benchmark section; an out-of-memory or other failure is a row, not the end."""
    try:
        fn()
    except torch.cuda.OutOfMemoryError as e:
        row(name, f"OUT OF MEMORY: {str(e).splitlines()[0]}")
    except Exception as e:
        row(name, f"FAILED: {type(e).__name__}: {e}")
    if DEV == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny model and small sizes: a CPU smoke run of the code paths")
    args = ap.parse_args()
    global VOCAB_HI
    if not args.tiny and DEV != "cuda":
        raise SystemExit("needs a CUDA GPU (use --tiny for a CPU smoke run)")
    row("device", torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu")
    t0 = time.perf_counter()
    model, config = build(args.tiny)
    VOCAB_HI = config.vocab_size - 1
    n = sum(p.numel() for p in model.parameters())
    row("model", f"Qwen3 architecture, {config.num_hidden_layers} layers, {n / 1e9:.2f}B "
                 f"params, random weights (built in {time.perf_counter() - t0:.0f} s)")
    small = args.tiny
    bsz = 8 if small else 128

    def decode():
        d = bench_decode(model, batch=bsz, prompt=256, new=16 if small else 128)
        row(f"hf decode, batch {bsz}", f"{d['decode_tok_s']:.0f} tok/s ({d['decode_tokens']} "
                                       f"tokens in {d['decode_s']:.1f} s)")

    def ig():
        r = bench_ig(model, n_traj=6, searches=6)
        row("IG time / old-logprob forward",
            f"{r['ig_time_ratio']:.3f} (forward {r['old_logprob_s']:.2f} s)")
        row("IG extra tokens / trajectory tokens", f"{r['ig_token_ratio']:.3f}")
        row("IG pass breakdown (s)", ", ".join(f"{k.removeprefix('seconds_')} {v:.2f}"
                                               for k, v in r["breakdown"].items()))

    # 2 x 2048 with gradient checkpointing: Qwen3-4B's weights, gradients and fused AdamW
    # states (8 + 8 + 16 GB) and the bf16 logits with their fp32 copy (~6 GB) fit one
    # 78 GiB H100; 4 x 2048 without checkpointing needed ~90 GiB
    tb, ts = (2, 256) if small else (2, 2048)

    def train():
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
        tr = bench_train(model, config, batch=tb, seq=ts)
        row(f"train step (fwd+bwd+AdamW, checkpointed), {tb}x{ts}",
            f"{tr['train_tok_s']:.0f} tok/s, {tr['train_step_s']:.2f} s/step, "
            f"MFU {tr['mfu']:.1%} of {H200_BF16_TFLOPS:.0f} TFLOP/s")

    for name, fn in (("hf decode", decode), ("IG", ig), ("train step", train)):
        section(name, fn)
    model.to("meta")  # its memory back before the search bench
    n_vec = 20_000 if small else 2_000_000

    def search():
        se = bench_search(n_vec, 768, 512 if small else 4096)
        row(f"flat top-3 search, {se['search_vectors']:,} x 768", f"{se['search_q_s']:.0f} q/s")

    section("flat search", search)


if __name__ == "__main__":
    main()
