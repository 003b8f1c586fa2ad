"""Peak memory of the log-prob pass: the full-vocabulary log-softmax against chunked log-probs
from hidden states (a2tgpo.algo.logprobs), at the papers' lengths and vocabulary.

One sequence of L = 6144 tokens, V = 151,936 (Qwen3), a small hidden size (the output layer's
input size does not change the (L, V) terms being compared), float32 on CPU. Each variant runs
in its own process, and the process's peak resident memory (ru_maxrss) minus its resident
memory just before the pass is reported; with --grad the pass includes the backward of a loss
on the log-probs and entropies, as the update does.

    python bench/logprob_memory.py [--grad] [--tokens 6144] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _child(variant: str, tokens: int, vocab: int, hidden: int, grad: bool,
           chunk: int | None) -> None:
    import torch

    from a2tgpo.algo.logprobs import DEFAULT_CHUNK_TOKENS, chunked_logprobs, entropy_from_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(tokens, hidden, requires_grad=grad)
    target = torch.randint(0, vocab, (tokens,))
    torch.set_grad_enabled(grad)
    base = _rss_mb()
    if variant == "full":
        logp = torch.log_softmax(head(h).float(), dim=-1)
        lp = logp.gather(-1, target[:, None]).squeeze(-1)
        ent = entropy_from_logprobs(logp_BTV=logp)
    else:
        lp, ent = chunked_logprobs(hidden_NH=h, project=head, target_N=target,
                                   with_entropy=True, chunk_tokens=chunk or DEFAULT_CHUNK_TOKENS)
    if grad:
        (lp.sum() + ent.sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"variant": variant, "peak_mb": peak - base}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=6144)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--grad", action="store_true")
    ap.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the "
                    "trainer's DEFAULT_CHUNK_TOKENS)")
    ap.add_argument("--child", choices=["full", "chunked"])
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.tokens, a.vocab, a.hidden, a.grad, a.chunk)
        return
    res = {}
    for variant in ("full", "chunked"):
        cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(a.tokens),
               "--vocab", str(a.vocab), "--hidden", str(a.hidden)] + (["--grad"] * a.grad) \
            + (["--chunk", str(a.chunk)] if a.chunk else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        res[variant] = json.loads(out.strip().splitlines()[-1])["peak_mb"]
    one = a.tokens * a.vocab * 4 / 2**20
    print(f"log-prob pass{' + backward' if a.grad else ''}: L={a.tokens}, V={a.vocab}, "
          f"one float32 (L, V) tensor = {one:,.0f} MB")
    print(f"  full     peak {res['full']:,.0f} MB")
    print(f"  chunked  peak {res['chunked']:,.0f} MB")
    print(f"  ratio full/chunked = {res['full'] / max(res['chunked'], 1e-9):.1f}x")


if __name__ == "__main__":
    main()
