"""The hf engine's rollouts with its prefix cache (each wave prefills only the new observation,
a question's identical prompts once) against the plain engine (every wave re-prefills the
whole history, every row its own prompt), on one toy cell's real rollouts.

A finished cell of the toy DAG gives everything (`./run snakemake` first): its config.yaml
names the backbone (the toy reader), the corpus, the index and the dev questions. Both engines
wrap the same model; for each repetition each runs `episodes.rollout` (the cell's method shape,
sampled at the config's temperature, one seed) over the first --questions dev questions, the
two interleaved; the median seconds over repetitions, the prompt tokens each prefilled, and
whether the two produced the same trajectories (token ids; sampled rollouts may part where the
padding's float effects flip a near-tie, greedy ones should not). One thread, as the toy's
training jobs run.

    python bench/rollout_prefix.py [--cell results/toy/runs/<cell>] [--questions 16] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from toy_cell import add_cell_args, load_cell


def main() -> None:
    from a2tgpo.rollout.hf_engine import HfEngine
    from a2tgpo.train.episodes import rollout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cell_args(ap, questions=16)
    ap.add_argument("--greedy", action="store_true", help="greedy rollouts (validation)")
    a = ap.parse_args()
    cfg, tok, model, tool, qs = load_cell(a.cell, a.questions)
    engines = {"plain": HfEngine(model, tok, prefix_cache_bytes=0), "cached": HfEngine(model, tok)}
    secs: dict[str, list[float]] = {k: [] for k in engines}
    ids: dict[str, list] = {}
    for _ in range(a.reps):
        for name, eng in engines.items():
            eng.tokens_prefilled = eng.tokens_reused = 0
            t0 = time.perf_counter()
            trajs = rollout(cfg, qs, eng, tool, seed=1, greedy=a.greedy)
            secs[name].append(time.perf_counter() - t0)
            ids[name] = [t.token_ids() for t in trajs]
    same = sum(x == y for x, y in zip(ids["plain"], ids["cached"], strict=True))
    print(f"{cfg.method.id}: {len(qs)} questions, {len(ids['cached'])} trajectories "
          f"({'greedy' if a.greedy else f'T={cfg.rollout.temperature}'}), {a.reps} reps")
    for name, eng in engines.items():
        print(f"  {name:7s} {statistics.median(secs[name]):6.2f} s  prefilled "
              f"{eng.tokens_prefilled:8,d} tokens  reused {eng.tokens_reused:8,d}")
    ratio = statistics.median(secs["plain"]) / statistics.median(secs["cached"])
    print(f"  plain / cached: {ratio:.2f}x time, "
          f"{engines['plain'].tokens_prefilled / engines['cached'].tokens_prefilled:.1f}x "
          f"prefilled tokens; identical trajectories {same}/{len(ids['cached'])}")


if __name__ == "__main__":
    main()
