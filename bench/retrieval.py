"""Retrieval benchmark: prints ratios measured in one run (ours vs the naive or peer way).

1. Dense retriever end to end (encode queries + faiss + corpus lookup) on the toy world:
   one batched call vs one call per query -> queries/s and the ratio.
2. faiss Flat (exact) vs HNSW on synthetic unit vectors of low intrinsic dimension: recall@3 of
   HNSW against Flat's exact top-3, batched queries/s of each, and the ratio.
3. Encoding passages in length-sorted batches vs in input order -> passages/s and the ratio.

Usage: ./run python bench/retrieval.py [--world results/toy/world] [--vectors 200000]
The toy world is generated into a temporary folder when --world is not given.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def timed(fn, repeat: int = 1) -> float:
    """Best wall time of `repeat` runs (the least disturbed by other work on the machine)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def world(path: str | None) -> Path:
    if path:
        return Path(path)
    from a2tgpo.data.world import WorldConfig, write_world

    d = Path(tempfile.mkdtemp(prefix="bench-world-"))
    write_world(WorldConfig(), d)
    return d


def bench_batching(world_dir: Path, n_queries: int) -> dict:
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.encoders import Encoder, EncoderConfig
    from a2tgpo.retrieval.index import IndexConfig, build_index, encode_shard, load_index
    from a2tgpo.retrieval.retriever import DenseRetriever

    tmp = Path(tempfile.mkdtemp(prefix="bench-index-"))
    docs = DocStore(world_dir / "corpus.jsonl")
    enc = Encoder(EncoderConfig())
    encode_shard(docs, enc, 0, 1, tmp / "s.npy", 10_000)
    build_index([tmp / "s.npy"], IndexConfig(num_shards=1), len(docs), tmp / "i.faiss", {})
    r = DenseRetriever(enc, load_index(tmp / "i.faiss", IndexConfig(), len(docs)), docs)
    questions = []
    for p in sorted((world_dir / "qa").glob("*/*.jsonl")):
        questions += [json.loads(line)["question"] for line in p.open()]
    qs = questions[:n_queries]
    r.search(qs[:8], 3)  # warm-up
    batched = timed(lambda: r.search(qs, 3), repeat=3)
    single = timed(lambda: [r.search([q], 3) for q in qs])
    return {"queries": len(qs), "batched_qps": len(qs) / batched,
            "single_qps": len(qs) / single}


def bench_hnsw(n: int, dim: int, n_queries: int, seed: int = 0) -> dict:
    import faiss

    rng = np.random.default_rng(seed)
    # text embeddings have a low intrinsic dimension; i.i.d. noise in 384 dimensions would make
    # every neighbour equidistant and no ANN index meaningful. Points on a random 24-dim
    # subspace, normalised, keep real nearest-neighbour structure.
    basis = rng.standard_normal((24, dim)).astype(np.float32)
    x = rng.standard_normal((n, 24)).astype(np.float32) @ basis
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.choice(n, n_queries, replace=False)] + 0.02 * rng.standard_normal(
        (n_queries, dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)

    flat = faiss.index_factory(dim, "Flat", faiss.METRIC_INNER_PRODUCT)
    flat.add(x)
    hnsw = faiss.index_factory(dim, "HNSW32", faiss.METRIC_INNER_PRODUCT)
    hnsw.hnsw.efConstruction = 80
    build_s = timed(lambda: hnsw.add(x))
    _, exact = flat.search(q, 3)
    flat_s = timed(lambda: flat.search(q, 3), repeat=3)
    out = {"vectors": n, "dim": dim, "queries": n_queries, "flat_qps": n_queries / flat_s,
           "hnsw_build_s": build_s, "hnsw": {}}
    for ef in (64, 128, 256):  # the recall / speed trade-off of the graph search depth
        hnsw.hnsw.efSearch = ef
        _, approx = hnsw.search(q, 3)
        recall = float(np.mean([len(set(a) & set(e)) / 3
                                for a, e in zip(approx, exact, strict=True)]))
        out["hnsw"][ef] = {"recall@3": recall,
                           "qps": n_queries / timed(lambda: hnsw.search(q, 3), repeat=3)}
    return out


def bench_sorting(world_dir: Path, n_passages: int) -> dict:
    from a2tgpo.retrieval.encoders import Encoder, EncoderConfig

    rows = [json.loads(line)["contents"] for line in (world_dir / "corpus.jsonl").open()]
    rng = np.random.default_rng(0)
    # real corpora mix short and long passages; so does this sample (1 to 4 passages joined)
    texts = [" ".join(rows[j] for j in rng.choice(len(rows), rng.integers(1, 5)))
             for _ in range(n_passages)]
    sorted_enc = Encoder(EncoderConfig(batch_size=32, sort_by_length=True))
    plain_enc = Encoder(EncoderConfig(batch_size=32, sort_by_length=False))
    sorted_enc.encode(texts[:32], "passage")
    s = timed(lambda: sorted_enc.encode(texts, "passage"), repeat=2)
    u = timed(lambda: plain_enc.encode(texts, "passage"), repeat=2)
    return {"passages": n_passages, "sorted_pps": n_passages / s, "unsorted_pps": n_passages / u}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", default=None, help="toy world directory (default: generate)")
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument("--vectors", type=int, default=200_000)
    ap.add_argument("--passages", type=int, default=512)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    w = world(args.world)

    b = bench_batching(w, args.queries)
    print(f"[1] dense retriever, {b['queries']} toy questions, top-3 (encode + faiss + lookup)")
    print(f"    batched {b['batched_qps']:.0f} q/s, one at a time {b['single_qps']:.0f} q/s "
          f"-> batched/one-at-a-time = {b['batched_qps'] / b['single_qps']:.1f}x")

    h = bench_hnsw(args.vectors, 384, 2000)
    print(f"[2] faiss on {h['vectors']:,} x {h['dim']} unit vectors (24-dim subspace), "
          f"{h['queries']} queries, top-3; Flat (exact) {h['flat_qps']:.0f} q/s; "
          f"HNSW32 build {h['hnsw_build_s']:.1f} s")
    for ef, r in h["hnsw"].items():
        print(f"    HNSW32 efSearch {ef:>3}: {r['qps']:.0f} q/s, recall@3 vs Flat "
              f"{r['recall@3']:.3f} -> HNSW/Flat = {r['qps'] / h['flat_qps']:.1f}x")

    s = bench_sorting(w, args.passages)
    print(f"[3] MiniLM encoding of {s['passages']} mixed-length passages, batch 32")
    print(f"    length-sorted {s['sorted_pps']:.0f} passages/s, input order "
          f"{s['unsorted_pps']:.0f} passages/s -> sorted/unsorted = "
          f"{s['sorted_pps'] / s['unsorted_pps']:.2f}x")


if __name__ == "__main__":
    main()
