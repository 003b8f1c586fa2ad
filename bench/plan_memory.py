"""The memory planner's pass terms against measured peaks, on CPU (a2tgpo.plan).

For scaled Qwen3 models (tens of millions of parameters, real 151,936-token vocabulary or a
smaller one so the layers dominate) and a few thousand tokens, each pass runs in its own
process on the trainer's own functions, and its peak resident memory (ru_maxrss) minus the
resident memory just before the pass is compared with the sum of the plan's terms for that
pass (`plan.update_terms` / `plan.nograd_terms`, fp32: 4 bytes per element). The weights and
their gradient buffers exist before the baseline (gradients are allocated by a first
backward), so the difference is what the pass adds: activations, log-prob chunks, the output
layer's gradient before accumulation, the KV cache of the IG pass.

    python bench/plan_memory.py [--quick] [--device cuda]

On a GPU (--device cuda, bf16) the measure is torch.cuda.max_memory_allocated() minus the
memory allocated before the pass, which is what the plan's terms describe there.

Passes: update (loss backward through `update.final_hidden` + `update.hidden_logprobs`, with
and without gradient checkpointing), old (no-grad `update.token_logprobs`), IG (the fused
`rollout.info_gain.score_gold_logprobs` forward, KV cache kept).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

MODELS = {
    # 45M parameters, 39M of them the embedding: the log-prob chunk dominates
    "qwen3-45m": dict(vocab_size=151936, hidden_size=256, intermediate_size=768,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64),
    # 42M parameters with a 32k vocabulary: the layers dominate
    "qwen3-42m": dict(vocab_size=32768, hidden_size=512, intermediate_size=1536,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=64),
}
CASES = [("update", False), ("update", True), ("old", False), ("ig", False)]
# glibc: every allocation over 64 KiB is its own mapping, returned to the system when freed,
# so resident memory follows the live tensors (glibc's default raises this threshold as large
# blocks are freed and then keeps freed memory in its heap, which resident memory would count)
CHILD_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _child(model_name: str, case: str, ckpt: bool, rows: int, length: int,
           device: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from a2tgpo.rollout.info_gain import score_gold_logprobs
    from a2tgpo.rollout.trajectory import Batch
    from a2tgpo.train.update import final_hidden, hidden_logprobs, token_logprobs

    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = Qwen3Config(**MODELS[model_name], tie_word_embeddings=True,
                      max_position_embeddings=2 * length, attn_implementation="sdpa")
    cuda = device == "cuda"
    model = Qwen3ForCausalLM(cfg).to(device, torch.bfloat16 if cuda else torch.float32)
    V = cfg.vocab_size
    ids = torch.randint(0, V, (rows, length))
    mask = torch.ones_like(ids)
    mask[-1, length // 2:] = 0  # a padded row, as batches have
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)

    def baseline() -> float:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return torch.cuda.memory_allocated() / 2**20
        return _rss_mb()

    if case == "update":
        if ckpt:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()

        def step():
            h = final_hidden(model, ids, mask, pos)
            lp, _ = hidden_logprobs(h, ids, model.get_output_embeddings())
            (lp * mask).sum().backward()

        # the gradient buffers exist before the baseline, as in training after update 1
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        base = baseline()
        step()
    elif case == "old":
        batch = Batch(input_ids=ids, attention_mask=mask, loss_mask=mask, turn_id=mask - 1,
                      position_ids=pos, rollout_logprobs=torch.zeros(rows, length),
                      turn_mask=torch.ones(rows, 1, dtype=torch.bool),
                      tool_call=torch.zeros(rows, 1, dtype=torch.bool),
                      prompt_lengths=torch.ones(rows, dtype=torch.long),
                      group_ids=list(range(rows)))
        base = baseline()
        with torch.no_grad():
            token_logprobs(model, batch, list(range(rows)), device=device)
    else:
        model.eval()
        trajs = [(ids[r, : int(mask[r].sum())].tolist(), []) for r in range(rows)]
        probes = [([5, 6, 7], (1, 2))] * rows
        base = baseline()
        score_gold_logprobs(model, trajs, probes, batch_size=rows)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"measured_mb": peak - base}))


def planned_mb(model_name: str, case: str, ckpt: bool, rows: int, length: int,
               b: int) -> float:
    from a2tgpo.model.backbone import ArchitectureConfig
    from a2tgpo.plan import ModelSizes, count_parameters, nograd_terms, update_terms

    arch = ArchitectureConfig(model_type="qwen3", tie_word_embeddings=True,
                              **MODELS[model_name])
    params, largest = count_parameters(arch)
    sizes = ModelSizes(arch=arch, params=params, largest_tensor=largest)
    T = rows * length  # padded tokens, as the passes compute them
    if case == "update":
        terms = update_terms(sizes, T, length, b, checkpointing=ckpt, entropy=False)
    else:
        terms = nograd_terms(sizes, T, length, b, case, cache=case == "ig")
    return sum(t.bytes for t in terms) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="one model, 1 x 1024 tokens, the checkpointed update and the IG pass")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        name, case, ckpt, rows, length = a.child
        _child(name, case, ckpt == "1", int(rows), int(length), a.device)
        return
    models = ["qwen3-45m"] if a.quick else list(MODELS)
    rows, length = (1, 1024) if a.quick else (2, 2048)
    b = 2 if a.device == "cuda" else 4
    measure = ("max_memory_allocated - allocated before the pass" if a.device == "cuda"
               else "peak RSS - RSS before the pass")
    print(f"{rows} x {length} tokens, {'bf16' if b == 2 else 'fp32'}, {a.device}; planned = "
          f"the plan's terms of the pass, measured = {measure}")
    print(f"{'model':<11} {'pass':<18} {'planned MB':>11} {'measured MB':>12} "
          f"{'planned/measured':>17}")
    worst = 0.0
    for name in models:
        for case, ckpt in ([("update", True), ("ig", False)] if a.quick else CASES):
            out = subprocess.run([sys.executable, __file__, "--device", a.device, "--child",
                                  name, case, str(int(ckpt)), str(rows), str(length)],
                                 capture_output=True, text=True, check=True, env=CHILD_ENV)
            measured = json.loads(out.stdout.strip().splitlines()[-1])["measured_mb"]
            planned = planned_mb(name, case, ckpt, rows, length, b)
            ratio = planned / measured
            worst = max(worst, abs(ratio - 1))
            label = case + (" (checkpointed)" if ckpt else "")
            print(f"{name:<11} {label:<18} {planned:>11.0f} {measured:>12.0f} {ratio:>17.2f}")
    print(f"largest deviation of planned from measured: {worst:.0%}")


if __name__ == "__main__":
    main()
