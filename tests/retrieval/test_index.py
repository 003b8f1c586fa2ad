"""Sharded encoding, index build, count checks and loading."""

import json

import faiss
import numpy as np
import pytest

from a2tgpo.retrieval.docstore import DocStore
from a2tgpo.retrieval.index import (
    IndexConfig,
    IndexMismatch,
    build_index,
    encode_shard,
    load_index,
    shard_range,
)


@pytest.mark.parametrize("n, k", [(10, 3), (7, 7), (5, 1), (3, 5)])
def test_shards_partition_the_rows(n, k):
    ranges = [shard_range(n, i, k) for i in range(k)]
    rows = [r for a, b in ranges for r in range(a, b)]
    assert rows == list(range(n))
    assert max(b - a for a, b in ranges) - min(b - a for a, b in ranges) <= 1


@pytest.fixture(scope="module")
def built(world_dir, encoder, tmp_path_factory):
    d = tmp_path_factory.mktemp("index")
    docs = DocStore(world_dir / "corpus.jsonl")
    cfg = IndexConfig(num_shards=3, chunk_size=10)
    shards = [d / f"s{i}.npy" for i in range(3)]
    for i, p in enumerate(shards):
        encode_shard(docs, encoder, i, 3, p, cfg.chunk_size)
    return d, docs, cfg, shards


def test_shards_equal_one_pass_encoding(built, encoder):
    d, docs, cfg, shards = built
    whole = encoder.encode([c for ch in docs.contents(0, len(docs)) for c in ch], "passage")
    np.testing.assert_allclose(np.concatenate([np.load(p) for p in shards]), whole, atol=1e-5)
    assert not any(d.glob("*.parts"))  # chunk folders are removed once a shard is complete


def test_killed_shard_resumes_from_its_chunks(built, encoder, tmp_path):
    _, docs, cfg, _ = built
    out = tmp_path / "s0.npy"
    parts = tmp_path / "s0.npy.parts"
    parts.mkdir()
    # a chunk left by a killed run: marked values, so reuse (not recomputation) is visible
    marked = np.full((10, encoder.dim), 7.0, dtype=np.float32)
    np.save(parts / "chunk_000000.npy", marked)
    emb = encode_shard(docs, encoder, 0, 3, out, cfg.chunk_size)
    assert (emb[:10] == 7.0).all() and not (emb[10:] == 7.0).any()
    assert np.load(out).shape == emb.shape


def test_build_flat_index_and_search_finds_itself(built, tmp_path):
    d, docs, cfg, shards = built
    meta = build_index(shards, cfg, len(docs), tmp_path / "x.faiss", {"corpus": "c"})
    assert meta["ntotal"] == len(docs) and meta["dim"] == 384 and meta["factory"] == "Flat"
    assert json.loads((tmp_path / "x.faiss.json").read_text()) == meta
    index = load_index(tmp_path / "x.faiss", cfg, len(docs))
    vecs = np.concatenate([np.load(p) for p in shards])
    _, rows = index.search(vecs[:5], 1)
    assert rows[:, 0].tolist() == [0, 1, 2, 3, 4]  # faiss id = corpus row


@pytest.mark.parametrize("factory", ["HNSW16", "IVF4,Flat", "IVF2,SQ8", "IVF2,PQ96x4"])
def test_other_factories(built, tmp_path, factory):
    _, docs, cfg, shards = built
    import dataclasses

    cfg = dataclasses.replace(cfg, factory=factory, nprobe=4)
    build_index(shards, cfg, len(docs), tmp_path / "x.faiss", {})
    index = load_index(tmp_path / "x.faiss", cfg, len(docs))
    assert index.ntotal == len(docs)
    vecs = np.concatenate([np.load(p) for p in shards])
    _, rows = index.search(vecs[:20], 3)
    # approximate, but a passage's own vector is among its 3 neighbours nearly always
    assert np.mean([i in r for i, r in enumerate(rows)]) >= 0.9


def test_count_mismatch_is_caught(built, tmp_path):
    d, docs, cfg, shards = built
    with pytest.raises(IndexMismatch, match=f"holds {len(docs):,} vectors but the corpus "
                                            f"has {len(docs) + 1:,} passages"):
        build_index(shards, cfg, len(docs) + 1, tmp_path / "x.faiss", {})
    assert not (tmp_path / "x.faiss").exists()
    build_index(shards, cfg, len(docs), tmp_path / "ok.faiss", {})
    with pytest.raises(IndexMismatch, match="but the corpus has"):
        load_index(tmp_path / "ok.faiss", cfg, len(docs) - 3)


def test_memory_estimate_refuses_oversized_load(built, tmp_path):
    d, docs, cfg, shards = built
    import dataclasses

    build_index(shards, cfg, len(docs), tmp_path / "x.faiss", {})
    tiny = dataclasses.replace(cfg, max_memory_fraction=1e-12)
    with pytest.raises(MemoryError, match="loading needs about"):
        load_index(tmp_path / "x.faiss", tiny, len(docs))


def test_gpu_on_without_gpu_is_an_error(built, tmp_path):
    _, docs, cfg, shards = built
    import dataclasses

    if faiss.get_num_gpus() > 0:
        pytest.skip("a GPU is visible")
    build_index(shards, cfg, len(docs), tmp_path / "x.faiss", {})
    with pytest.raises(RuntimeError, match="faiss sees no GPU"):
        load_index(tmp_path / "x.faiss", dataclasses.replace(cfg, gpu="on"), len(docs))
