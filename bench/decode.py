"""The hf engine's decoding against transformers' stock path, lever by lever, on one toy cell's
real rollouts: greedy evaluation of dev questions (different questions under one instruction
prompt) and the cell's sampled training rollouts.

Levers, each added to the one before: `sdpa` attention with transformers' DynamicCache (stock:
both copy the whole KV cache at every decoded token, the attention to repeat the grouped key
and value heads, the cache to append by torch.cat); the grouped heads passed to torch's kernel
uncopied (`a2tgpo.model.fast_decode.ATTENTION`); the in-place appending cache
(`fast_decode.new_cache`); the prompts' common prefix run once (`HfEngine.common_prefix`).
Every configuration keeps the prefix cache across turns (bench/rollout_prefix.py measures that).
For each repetition each runs `episodes.rollout` over the first --questions dev questions, the
configurations interleaved; the median seconds, the ratio to stock, and whether the
trajectories (token ids) are those of stock. One thread, as the toy's jobs run.

A finished cell of the toy DAG gives everything (`./run snakemake` first).

    python bench/decode.py [--cell results/toy/runs/<cell>] [--questions 60] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from toy_cell import add_cell_args, load_cell


def main() -> None:
    from a2tgpo.model.fast_decode import STOCK_ATTENTION, register_attention, use_fast_path
    from a2tgpo.rollout.hf_engine import HfEngine
    from a2tgpo.train.episodes import rollout

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cell_args(ap, questions=60)
    a = ap.parse_args()
    if not use_fast_path():  # the engine would fall back: every row would measure stock
        raise SystemExit("this transformers is not one the fast path was verified against "
                         "(a2tgpo/model/fast_decode.py VERIFIED)")
    fast = register_attention()
    cfg, tok, model, tool, qs = load_cell(a.cell, a.questions)
    # name -> (attention, engine keyword arguments)
    configs = {
        "stock": (STOCK_ATTENTION, dict(fast_path=False, common_prefix=False)),
        "+ gqa attention": (fast, dict(fast_path=False, common_prefix=False)),
        "+ append cache": (fast, dict(fast_path=True, common_prefix=False)),
        "+ common prefix": (fast, dict(fast_path=True, common_prefix=True)),
    }
    for greedy, n_q in ((True, len(qs)), (False, min(8, len(qs)))):
        secs: dict[str, list[float]] = {k: [] for k in configs}
        ids: dict[str, list] = {}
        for _ in range(a.reps):
            for name, (attention, kw) in configs.items():
                model.set_attn_implementation(attention)
                eng = HfEngine(model, tok, max_batch=32, **kw)
                t0 = time.perf_counter()
                trajs = rollout(cfg, qs[:n_q], eng, tool, seed=1, greedy=greedy)
                secs[name].append(time.perf_counter() - t0)
                ids[name] = [t.token_ids() for t in trajs]
        kind = "greedy (evaluation)" if greedy else f"sampled T={cfg.rollout.temperature}"
        print(f"{cfg.method.id}: {n_q} questions, {len(ids['stock'])} trajectories, {kind}, "
              f"{a.reps} reps")
        base = statistics.median(secs["stock"])
        for name in configs:
            same = sum(x == y for x, y in zip(ids["stock"], ids[name], strict=True))
            t = statistics.median(secs[name])
            print(f"  {name:16s} {t:6.2f} s  stock / this {base / t:4.2f}x  "
                  f"trajectories as stock {same}/{len(ids[name])}")


if __name__ == "__main__":
    main()
