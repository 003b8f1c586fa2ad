"""Computed / real tokens of the update: every row padded to the step's longest (one padded
batch, as before token-budget micro-batches) against micro-batches packed under a token budget
(a2tgpo.train.update.micro_batches), on synthetic lengths drawn to match the papers' multi-hop
spread.

Lengths (an assumption, stated so the ratio can be redone with other numbers): prompt
U(250, 350); 2-4 tool calls, each an action of U(150, 600) tokens and an observation of
U(350, 500) (3 passages); a final answer turn of U(100, 400); capped at prompt + 6192. One step
is 64 prompts x 16 rollouts, updated in 8 mini-batches of 8 prompts on 8 ranks.

    python bench/padding.py [--budget 16384 32768 49152]
"""

from __future__ import annotations

import argparse
import random

from a2tgpo.train.update import micro_batches


def lengths(rng: random.Random, n: int) -> list[int]:
    out = []
    for _ in range(n):
        prompt = rng.randint(250, 350)
        body = sum(rng.randint(150, 600) + rng.randint(350, 500)
                   for _ in range(rng.randint(2, 4))) + rng.randint(100, 400)
        out.append(prompt + min(body, 6192))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, nargs="*", default=[16384, 32768, 49152])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    prompts, n, mini = 64, 16, 8
    L = lengths(rng, prompts * n)
    real = sum(L)
    padded = len(L) * max(L)  # one batch padded to the step's longest row
    print(f"{len(L)} rows, {real:,} real tokens; longest {max(L)}, mean {real / len(L):.0f}")
    print(f"  padded to the step's longest row : computed/real = {padded / real:.2f}")
    for budget in a.budget:
        computed = 0
        for m in range(0, prompts, mini):
            rows = list(range(m * n, (m + mini) * n))
            lens = {b: L[b] for b in rows}
            plan = micro_batches(lens, rows, a.ranks, max_rows=1, max_tokens=budget)
            computed += sum(len(mb) * max(lens[b] for b in mb)
                            for rank in plan for mb in rank if mb)
        print(f"  token budget {budget:>6} per micro-batch : computed/real = {computed / real:.2f}")


if __name__ == "__main__":
    main()
