"""Sharded encoding, index build, count checks and loading."""

import json

import faiss
import numpy as np
import pytest

from a2tgpo.retrieval.docstore import DocStore
from a2tgpo.retrieval.index import (
    IndexConfig,
    IndexMismatch,
    alignment_rows,
    build_index,
    check_alignment,
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


def test_width_mismatch_with_retrieval_index_dim_is_caught(built, tmp_path):
    import dataclasses

    _, docs, cfg, shards = built
    d = np.load(shards[0]).shape[1]
    build_index(shards, cfg, len(docs), tmp_path / "x.faiss", {})
    assert load_index(tmp_path / "x.faiss", dataclasses.replace(cfg, dim=d), len(docs)).d == d
    with pytest.raises(IndexMismatch, match=f"vectors of width {d}, but retrieval.index.dim "
                                            f"is {d + 1}"):
        load_index(tmp_path / "x.faiss", dataclasses.replace(cfg, dim=d + 1), len(docs))


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


def _cgroup_tree(tmp_path, lines, files):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cgroup").write_text("\n".join(lines) + "\n")
    for rel, text in files.items():
        f = tmp_path / "fs" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_the_memory_guard_reads_the_jobs_cgroup_limit(tmp_path):
    from a2tgpo.retrieval.index import cgroup_memory_left

    # cgroup v2, a SLURM job cgroup of 8 GiB with 3 GiB used, inside an unlimited parent
    gib = 2**30
    proc, root = _cgroup_tree(tmp_path / "v2", ["0::/slurm/job_7/step_0"], {
        "slurm/job_7/step_0/memory.max": "max", "slurm/job_7/step_0/memory.current": "1",
        "slurm/job_7/memory.max": str(8 * gib), "slurm/job_7/memory.current": str(3 * gib),
        "memory.max": "max", "memory.current": "5"})
    assert cgroup_memory_left(proc, root) == 5 * gib
    # cgroup v1: limit_in_bytes / usage_in_bytes under the memory controller; the tighter of
    # the process's cgroup (4 GiB - 1 GiB) and its parent's (10 GiB - 9.5 GiB) binds
    proc, root = _cgroup_tree(tmp_path / "v1", ["4:memory:/slurm/uid_0/job_9", "3:cpu:/"], {
        "memory/slurm/uid_0/job_9/memory.limit_in_bytes": str(4 * gib),
        "memory/slurm/uid_0/job_9/memory.usage_in_bytes": str(1 * gib),
        "memory/slurm/uid_0/memory.limit_in_bytes": str(10 * gib),
        "memory/slurm/uid_0/memory.usage_in_bytes": str(int(9.5 * gib)),
        "memory/memory.limit_in_bytes": str(2**63 - 4096),  # v1's "unlimited"
        "memory/memory.usage_in_bytes": "0"})
    assert cgroup_memory_left(proc, root) == gib // 2
    # no memory controller, or no limit anywhere: None (the node's free memory decides)
    proc, root = _cgroup_tree(tmp_path / "none", ["3:cpu:/"], {})
    assert cgroup_memory_left(proc, root) is None
    assert cgroup_memory_left(str(tmp_path / "missing"), root) is None


# --------------------------------------------------------------------------------------------
# alignment: index row i must hold corpus row i's vector


def test_alignment_sample_is_spread_seeded_and_holds_both_ends():
    rows = alignment_rows(1000, 16)
    assert len(rows) == 16 and rows[0] == 0 and rows[-1] == 999
    # one row per stratum of 1000 // 16 = 62 or 63 rows: sorted, distinct, spread
    assert all(k * 1000 // 16 <= r < (k + 1) * 1000 // 16 for k, r in enumerate(rows))
    assert (alignment_rows(1000, 16) == rows).all()  # fixed for a seed
    assert (alignment_rows(1000, 16, seed=1)[1:-1] != rows[1:-1]).any()
    assert alignment_rows(5, 32).tolist() == [0, 1, 2, 3, 4]  # a small corpus: every row


def flat_index(vectors: np.ndarray, path, factory: str = "Flat", nprobe: int = 4):
    """An index of exactly `vectors` (row i = vectors[i]), written and loaded like a built one."""
    import dataclasses

    cfg = dataclasses.replace(IndexConfig(), factory=factory, nprobe=nprobe)
    np.save(path.with_suffix(".npy"), vectors)
    build_index([path.with_suffix(".npy")], cfg, len(vectors), path, {})
    return load_index(path, cfg, len(vectors))


@pytest.fixture(scope="module")
def vectors(built):
    _, _, _, shards = built
    return np.concatenate([np.load(p) for p in shards])


@pytest.mark.parametrize("factory, method", [("Flat", "reconstruct"), ("HNSW16", "reconstruct"),
                                             ("IVF4,Flat", "reconstruct"),
                                             ("IVF2,SQ8", "search")])
def test_aligned_index_passes(built, vectors, encoder, tmp_path, factory, method):
    _, docs, _, _ = built
    index = flat_index(vectors, tmp_path / "i.faiss", factory)
    record = check_alignment(index, docs, encoder, "i.faiss", sample=16)
    assert record["method"] == method and record["rows"] == alignment_rows(len(docs), 16).tolist()
    if method == "reconstruct":
        assert record["min_cosine"] > 0.9999  # the same encoder in fp32 twice
    else:
        assert record["passed"] >= 0.9 * 16


def test_a_lower_precision_encoder_passes(built, vectors, tmp_path):
    # a GPU build encodes in fp16/bf16 and check-index re-encodes on CPU in fp32, or the reverse
    # as here: an fp32 index checked with bf16 weights (bf16 differs more than fp16)
    from a2tgpo.retrieval.encoders import Encoder, EncoderConfig

    _, docs, _, _ = built
    bf16 = Encoder(EncoderConfig(batch_size=16, dtype="bfloat16", device="cpu"))
    record = check_alignment(flat_index(vectors, tmp_path / "i.faiss"), docs, bf16, "i.faiss",
                             sample=8)
    # measured 1 - cosine ~6e-5: a real difference, far inside the 0.99 threshold
    assert 1e-5 < 1 - record["min_cosine"] < 1e-3


@pytest.mark.parametrize("factory", ["Flat", "IVF4,Flat", "IVF2,SQ8"])
def test_shifted_index_of_the_right_size_is_caught(built, vectors, encoder, tmp_path, factory):
    _, docs, _, _ = built
    n = len(docs)
    # rows 1..n-1, then row 0: the count matches, every row holds its successor's vector
    index = flat_index(np.roll(vectors, -1, axis=0), tmp_path / "i.faiss", factory)
    assert index.ntotal == n
    with pytest.raises(IndexMismatch) as e:
        check_alignment(index, docs, encoder, "i.faiss", sample=16)
    msg = str(e.value)
    first_id = docs.get([0])[0]["id"]
    # corpus row 0's vector sits at index row n - 1; the sample's first row is row 0
    assert msg.startswith("i.faiss: index rows do not hold the vectors of the same corpus rows")
    # every sampled row fails: a successor passage scores <= 0.77 against the re-encoded one
    # (toy corpus, MiniLM), far from both the cosine threshold and the search tolerance
    assert " 16 sampled passages " in msg and "; 16 failed " in msg
    assert f"First: row 0 (id {first_id!r}): " in msg
    assert f"its passage is nearest to index row {n - 1}" in msg


def test_index_of_another_corpus_is_caught(built, encoder, tmp_path):
    _, docs, _, _ = built
    # unit vectors of the encoder's width that no passage of this corpus encodes to
    other = np.random.default_rng(0).standard_normal((len(docs), encoder.dim), np.float32)
    other /= np.linalg.norm(other, axis=1, keepdims=True)
    index = flat_index(other, tmp_path / "i.faiss")
    with pytest.raises(IndexMismatch, match=r" 8 sampled passages .*; 8 failed .*cosine >= 0\.99"):
        check_alignment(index, docs, encoder, "i.faiss", sample=8)
    # and a different width is named as such
    with pytest.raises(IndexMismatch, match="vectors of width 8, but the configured encoder"):
        check_alignment(flat_index(other[:, :8].copy(), tmp_path / "n.faiss"), docs, encoder,
                        "n.faiss")


def test_factory_error_tries_the_factory_as_build_index_makes_it():
    from a2tgpo.retrieval.index import factory_error

    assert factory_error("Flat", 384) is None and factory_error("IVF64,PQ8", 384) is None
    assert "could not parse index string Flatt" in factory_error("Flatt", 384)
    # PQ7 needs a width divisible by 7: not 384, but a width unknown yet is tried at
    # lcm(768, 7) = 5376, so the factory is not refused for a width nobody gave
    assert "d % M == 0" in factory_error("PQ7", 384)
    assert factory_error("PQ7", None) is None
    # lcm(768, 7919) = 6,082,752 > 2^16: no encoder is that wide
    assert "no encoder width up to 65,536" in factory_error("PQ7919", None)
    # LSH takes the L2 metric only; the index is always inner product
    assert "metric == METRIC_L2" in factory_error("LSH", 384)
    # refused before faiss allocates 10^8 inverted lists
    assert factory_error("IVF100000000,Flat", 384).startswith("100,000,000 is above 4,194,304")
