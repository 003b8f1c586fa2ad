"""Dense index build and load: sharded corpus encoding, one faiss index from a factory string.

Build (DAG stages): `encode_shard` embeds rows [start, end) of the corpus for shard i of N (one
job each; within a job, finished chunks are kept, so a killed job resumes where it stopped),
then `build_index` adds the shards in order to `faiss.index_factory(d, factory, IP)` (Flat by
default, as Search-R1; IVF-PQ and HNSW selectable), checks that the index holds exactly one
vector per corpus passage, and writes it atomically with a metadata file. Search-R1's prebuilt
e5 Flat index can be used instead of encoding; the same count check applies.

Check (`a2tgpo check-index`): besides the count, `check_alignment` re-encodes a fixed sample of
passages and checks that index row i holds corpus row i's vector, which a count cannot see (an
index of the right size built from rows in another order, or from another corpus).

Load: the memory the index needs is estimated from its file before reading it; with faiss-gpu
installed the index is sharded across all visible GPUs in fp16, as Search-R1's server does.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from a2tgpo.config import option
from a2tgpo.io import atomic_path, atomic_write_json

log = logging.getLogger(__name__)


class IndexMismatch(ValueError):
    """The index and the corpus disagree (vector count, dimension, row alignment or encoder)."""


@dataclass(frozen=True)
class IndexConfig:
    """The dense index (retrieval.index)."""

    factory: str = option(
        "Flat",
        "faiss index_factory string: Flat (exact, Search-R1's choice), HNSW32, "
        "IVF4096,PQ64, ...; the metric is always inner product.",
    )
    num_shards: int = option(2, "Corpus encoding jobs (one Snakemake job per shard).", ge=1)
    chunk_size: int = option(
        10_000, "Rows per saved chunk inside a shard job (the unit a killed job resumes from).",
        ge=1
    )
    train_size: int = option(
        200_000, "Vectors sampled to train indexes that need it (IVF, PQ); capped at the corpus.",
        ge=1
    )
    nprobe: int = option(64, "IVF lists probed per query.", ge=1)
    ef_search: int = option(128, "HNSW search depth (efSearch).", ge=1)
    prebuilt: str | None = option(
        None, "Path to a prebuilt index (e.g. Search-R1's e5_Flat.index) to use instead of "
        "encoding the corpus; null = build.",
    )
    gpu: Literal["auto", "on", "off"] = option(
        "auto", "Shard the index over all GPUs in fp16 (needs faiss-gpu); auto = when present."
    )
    dim: int | None = option(
        None, "Width of the index's vectors (the encoder's hidden size: 768 for e5-base-v2), "
        "checked when the index loads; lets `a2tgpo plan` size a Flat index not on disk yet "
        "(corpus rows x dim x 4 B). null = the encoder's config.json when it is on disk.", ge=1)
    max_memory_fraction: float = option(
        0.9, "Refuse to load an index estimated to need more than this fraction of free RAM.", gt=0,
        le=1)

    def __post_init__(self) -> None:
        if self.num_shards < 1 or self.chunk_size < 1:
            raise ValueError("num_shards and chunk_size must be >= 1")
        if self.dim is not None and self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")


# A factory string is tried at load on an empty index (milliseconds), then discarded. Its width
# is the encoder's when known, else PROBE_DIM (BERT-base's, e5-base-v2's) raised to a multiple
# of every PQ/OPQ sub-quantizer count it names, as a real width must be. Counts above
# MAX_FACTORY_COUNT are refused unprobed: faiss allocates an IVF's lists when the index is made
# (IVF2^22: 0.5 s and 0.5 GB), and 2^22 lists is faiss's own largest guideline, for a billion
# vectors.
PROBE_DIM = 768
MAX_PROBE_DIM = 2**16
MAX_FACTORY_COUNT = 2**22


def factory_error(factory: str, dim: int | None = None) -> str | None:
    """Why `faiss.index_factory(dim, factory, inner product)` refuses `factory` (None: it
    builds), as build_index calls it; `dim`: the encoder's width, None = unknown (above)."""
    # faiss's loader logs every CPU build it tries ("Could not load library with AVX512
    # support"): noise in a config check
    loader = logging.getLogger("faiss.loader")
    level = loader.level
    loader.setLevel(logging.WARNING)
    try:
        import faiss
    finally:
        loader.setLevel(level)

    counts = [int(n) for n in re.findall(r"\d+", factory)]
    if any(n > MAX_FACTORY_COUNT for n in counts):
        return (f"{max(counts):,} is above {MAX_FACTORY_COUNT:,} (2^22 IVF lists, faiss's "
                "guideline for a billion vectors)")
    if dim is None:
        dim = math.lcm(PROBE_DIM, *(int(m) for m in re.findall(r"PQ(\d+)", factory)))
        if dim > MAX_PROBE_DIM:
            return (f"no encoder width up to {MAX_PROBE_DIM:,} is a multiple of its PQ "
                    "sub-quantizer counts (set retrieval.index.dim to the encoder's width if "
                    "this is meant)")
    try:
        faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        # faiss prefixes its reason with the C++ function and source line
        reason = re.sub(r"^Error in .*? at \S+:\d+: ", "", str(e).strip().splitlines()[-1])
        return f"faiss.index_factory({dim}, {factory!r}, inner product) fails: {reason}"
    return None


def shard_range(n_rows: int, shard: int, num_shards: int) -> tuple[int, int]:
    """Contiguous rows of shard `shard` of `num_shards` (sizes differ by at most one)."""
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} not in [0, {num_shards})")
    return n_rows * shard // num_shards, n_rows * (shard + 1) // num_shards


def encode_shard(docs, encoder, shard: int, num_shards: int, out_path: str | Path,
                 chunk_size: int) -> np.ndarray:
    """Embed the shard's rows into `out_path` (.npy, float32 (rows, D)), resumably.

    Finished chunks live in `<out_path>.parts/` until the whole shard is written; a rerun
    skips them. Returns the shard's embeddings.
    """
    from a2tgpo.progress import progress_bar

    out_path = Path(out_path)
    start, end = shard_range(len(docs), shard, num_shards)
    parts = out_path.with_name(out_path.name + ".parts")
    parts.mkdir(parents=True, exist_ok=True)
    chunks = []
    for k, s in enumerate(progress_bar(range(start, end, chunk_size), desc=f"shard {shard}",
                               unit="chunk")):
        path = parts / f"chunk_{k:06d}.npy"
        if path.exists():
            chunks.append(np.load(path))
            continue
        (texts,) = docs.contents(s, min(end, s + chunk_size), chunk=chunk_size)
        emb = encoder.encode(texts, "passage")
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.save(f, emb)
        chunks.append(emb)
    emb = np.concatenate(chunks) if chunks else np.zeros((0, encoder.dim), np.float32)
    if len(emb) != end - start:
        raise RuntimeError(f"{parts}: chunks hold {len(emb)} rows, shard needs {end - start}; "
                           "delete the folder and rerun")
    with atomic_path(out_path) as tmp, open(tmp, "wb") as f:
        np.save(f, emb)
    shutil.rmtree(parts)
    log.info("shard %d/%d: rows [%d, %d) -> %s", shard, num_shards, start, end, out_path)
    return emb


def build_index(shard_paths: list[str | Path], cfg: IndexConfig, n_passages: int,
                out_path: str | Path, meta: dict) -> dict:
    """Add the shards in order to one faiss index; check its count; write it atomically.

    `meta` (encoder, corpus) is stored next to the index as `<out_path>.json` and returned.
    """
    import faiss

    arrays = [np.load(p, mmap_mode="r") for p in shard_paths]
    dims = {a.shape[1] for a in arrays}
    if len(dims) != 1:
        raise IndexMismatch(f"shards have different dimensions {sorted(dims)}: {shard_paths}")
    (dim,) = dims
    index = faiss.index_factory(dim, cfg.factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        # a sample spread over the whole corpus, not its first rows
        total = sum(len(a) for a in arrays)
        rng = np.random.default_rng(0)
        take = np.sort(rng.choice(total, size=min(cfg.train_size, total), replace=False))
        allv = _gather(arrays, take)
        log.info("training %s on %d vectors", cfg.factory, len(allv))
        index.train(np.ascontiguousarray(allv, dtype=np.float32))
    for a in arrays:
        for s in range(0, len(a), 100_000):
            index.add(np.ascontiguousarray(a[s: s + 100_000], dtype=np.float32))
    check_count(index.ntotal, n_passages, out_path)
    meta = {**meta, "factory": cfg.factory, "dim": int(dim), "ntotal": int(index.ntotal)}
    with atomic_path(out_path) as tmp:
        faiss.write_index(index, str(tmp))
    atomic_write_json(meta_path(out_path), meta)
    return meta


def _gather(arrays, rows: np.ndarray) -> np.ndarray:
    """Rows (global positions, sorted) from a list of memory-mapped shards."""
    out, offset = [], 0
    for a in arrays:
        local = rows[(rows >= offset) & (rows < offset + len(a))] - offset
        out.append(np.asarray(a[local]))
        offset += len(a)
    return np.concatenate(out)


def meta_path(index_path: str | Path) -> Path:
    return Path(str(index_path) + ".json")


def check_count(ntotal: int, n_passages: int, where) -> None:
    if ntotal != n_passages:
        raise IndexMismatch(
            f"{where}: the index holds {ntotal:,} vectors but the corpus has {n_passages:,} "
            "passages; faiss ids are corpus row numbers, so every hit would return the wrong "
            "passage. Rebuild the index from this corpus (or point to the matching corpus)."
        )


# Re-encoding a passage with the encoder that built the index reproduces its vector up to
# rounding: measured on the toy corpus with MiniLM, cosine >= 0.99999 between fp32 runs with
# other batchings, and >= 0.99993 between an fp16 or bf16 encoding and an fp32 one (a GPU build
# checked on CPU). Two different passages score far lower unless their texts nearly coincide
# (then a shift between them is nearly harmless too): at most 0.77 between any two toy
# passages. 0.99 rejects a shifted or foreign row with room to spare for precision.
ALIGNMENT_MIN_COSINE = 0.99
# For indexes that store codes, not vectors (PQ, SQ, ...): a row passes when its own re-encoded
# passage finds it among the top SEARCH_K hits scoring within SEARCH_REL_TOL of the best hit
# (duplicate passages tie; quantization shifts scores by a few hundredths); approximate search
# may miss a row now and then, so SEARCH_MIN_PASS of the sample must pass. In a shifted index a
# row holds another passage's vector and scores ~0.3-0.5 below the best hit.
SEARCH_K, SEARCH_REL_TOL, SEARCH_MIN_PASS = 10, 0.05, 0.9


def alignment_rows(n_rows: int, size: int, seed: int = 0) -> np.ndarray:
    """A fixed sample of `min(size, n_rows)` distinct rows spread over the corpus: one drawn
    (seeded) from each of `size` equal strata, then the first and last rows put in place of
    their strata's draws, so an index offset at either end is always seen. Sorted."""
    if size < 2:
        raise ValueError(f"the alignment sample needs at least 2 rows, got {size}")
    k = min(size, n_rows)
    if k == n_rows:
        return np.arange(n_rows)
    edges = np.arange(k + 1) * n_rows // k  # strictly increasing since n_rows > k
    rows = np.random.default_rng(seed).integers(edges[:-1], edges[1:])
    rows[0], rows[-1] = 0, n_rows - 1
    return rows


def _stores_vectors(index) -> bool:
    """Whether `index.reconstruct(i)` returns row i's vector exactly (as added, in fp32)."""
    import faiss

    idx = faiss.downcast_index(index)
    return isinstance(idx, faiss.IndexFlat | faiss.IndexHNSWFlat | faiss.IndexIVFFlat
                      | faiss.IndexRefineFlat)


def check_alignment(index, docs, encoder, where, *, sample: int = 32, seed: int = 0,
                    min_cosine: float = ALIGNMENT_MIN_COSINE) -> dict:
    """Check that index row i holds the vector of corpus row i, on a fixed sample of rows.

    The sampled passages (`alignment_rows`) are re-encoded with `encoder`, which must be
    configured as the build's was. Indexes that store the vectors (Flat, HNSW*Flat, IVF*Flat)
    compare each with its stored vector (`reconstruct`): every cosine must reach
    `min_cosine`. Others are searched with the re-encoded vectors (SEARCH_* above). Raises
    IndexMismatch naming the first misaligned rows, their corpus ids and where their passages
    are stored instead; returns what was checked (for the check record).
    """
    import faiss

    if index.d != encoder.dim:
        raise IndexMismatch(f"{where}: vectors of width {index.d}, but the configured encoder "
                            f"gives {encoder.dim}: the index was built with another encoder")
    rows = alignment_rows(index.ntotal, sample, seed)
    got = docs.get(rows.tolist())
    q = encoder.encode([r["contents"] for r in got], "passage")  # (S, D)
    exact = _stores_vectors(index)
    record = {"rows": rows.tolist(), "seed": seed, "encoder": getattr(encoder.cfg, "model", None),
              "method": "reconstruct" if exact else "search"}
    if exact:
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None:
            ivf.make_direct_map()  # IVF lists are unordered; reconstruct needs the row -> slot map
        stored = np.stack([index.reconstruct(int(r)) for r in rows])  # (S, D)
        score = _cosine(q, stored)  # (S,)
        bad = np.flatnonzero(score < min_cosine)
        record |= {"min_cosine": float(score.min()), "required_cosine": min_cosine}
        need = f"cosine >= {min_cosine} between each re-encoded passage and its stored vector"
    else:
        k = min(SEARCH_K, index.ntotal)
        scores, hits = index.search(q, k)  # (S, k) each
        score = np.full(len(rows), -np.inf, dtype=np.float32)  # own score (-inf: not in top k)
        for j, r in enumerate(rows):
            where_r = np.flatnonzero(hits[j] == r)
            if len(where_r):
                score[j] = scores[j, where_r[0]]
        passed = score >= scores[:, 0] - SEARCH_REL_TOL * np.abs(scores[:, 0])
        bad = np.flatnonzero(~passed)
        record |= {"passed": int(passed.sum()), "required_fraction": SEARCH_MIN_PASS,
                   "top_k": k}
        need = (f"each row among its own re-encoded passage's top {k} hits within "
                f"{SEARCH_REL_TOL:.0%} of the best score, for >= {SEARCH_MIN_PASS:.0%} of rows")
    failed = len(bad) > 0 if exact else passed.mean() < SEARCH_MIN_PASS
    log.info("alignment (%s): re-encoded %d corpus rows (first %d, last %d, seed %d) with %s; "
             "%d of them misaligned; required: %s", record["method"], len(rows), rows[0],
             rows[-1], seed, record["encoder"], len(bad), need)
    if failed:
        _, found = index.search(q[bad[:5]], 1)  # where each passage's vector really is
        first = "; ".join(
            f"row {rows[j]} (id {got[j]['id']!r}): "
            + (f"cosine {score[j]:.3f}" if exact else
               ("not in the top hits" if np.isinf(score[j]) else f"score {score[j]:.3f} vs "
                f"best {scores[j, 0]:.3f}"))
            + f", its passage is nearest to index row {int(found[i, 0])}"
            for i, j in enumerate(bad[:5]))
        raise IndexMismatch(
            f"{where}: index rows do not hold the vectors of the same corpus rows: re-encoded "
            f"{len(rows)} sampled passages with the configured encoder ({record['encoder']}); "
            f"{len(bad)} failed (required: {need}). First: {first}. The index was built from "
            "another corpus, another row order or another encoder configuration; rebuild it "
            "from this corpus, or point to the corpus and encoder it was built with.")
    return record


def _cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine of (S, D) arrays; 0 where either row is zero."""
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return np.where(norms > 0, (a * b).sum(1) / np.maximum(norms, 1e-30), 0.0)


def cgroup_memory_left(proc_cgroup: str = "/proc/self/cgroup",
                       root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup still allows (limit - usage, bytes), or None without
    a limit. A SLURM job with --mem runs in such a cgroup (task/cgroup): the node may have
    far more free memory than the job may use. cgroup v2 (memory.max, memory.current) and v1
    (memory.limit_in_bytes, memory.usage_in_bytes); the tightest of the process's cgroup and
    its parents, since a parent's limit binds too."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: the unified hierarchy
            candidates.append((Path(root), path, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):
            candidates.append((Path(root) / "memory", path, "memory.limit_in_bytes",
                               "memory.usage_in_bytes"))
    left = None
    for base, path, limit_name, usage_name in candidates:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            d = base.joinpath(*parts[:depth])
            try:
                limit = (d / limit_name).read_text().strip()
                usage = int((d / usage_name).read_text().strip())
            except (OSError, ValueError):
                continue
            # "max" (v2) or a huge number (v1's "unlimited", ~2**63) is no limit
            if limit == "max" or int(limit) >= 2**60:
                continue
            room = max(0, int(limit) - usage)
            left = room if left is None else min(left, room)
    return left


def available_memory_bytes() -> int:
    """The memory this process can still take: MemAvailable from /proc/meminfo (else total
    physical memory), capped by its cgroup's limit (a SLURM job's --mem)."""
    node = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    node = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if node is None:
        node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    job = cgroup_memory_left()
    return node if job is None else min(node, job)


def load_index(path: str | Path, cfg: IndexConfig, n_passages: int):
    """Read the index (after a memory estimate), check its count, move it to GPUs if asked."""
    import faiss

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"index {path} not found")
    # a faiss file holds the vectors (and graph or codes) nearly byte for byte: its size is
    # what reading it will take in RAM
    need = path.stat().st_size
    free = available_memory_bytes()
    log.info("index %s needs about %.2f GiB of RAM to load (%.2f GiB available)",
             path, need / 2**30, free / 2**30)
    if need > cfg.max_memory_fraction * free:
        raise MemoryError(
            f"{path}: loading needs about {need / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB "
            f"is available to this job (its memory cgroup, e.g. SLURM's --mem, or the node's "
            f"free memory; limit {cfg.max_memory_fraction:.0%}); request more memory, "
            "a compressed index (e.g. factory IVF4096,PQ64) or faiss-gpu sharding"
        )
    index = faiss.read_index(str(path))
    check_count(index.ntotal, n_passages, path)
    if cfg.dim is not None and index.d != cfg.dim:
        raise IndexMismatch(f"{path}: vectors of width {index.d}, but retrieval.index.dim is "
                            f"{cfg.dim}")
    if hasattr(index, "nprobe"):
        index.nprobe = cfg.nprobe
    hnsw = getattr(index, "hnsw", None)
    if hnsw is not None:
        hnsw.efSearch = cfg.ef_search
    ngpu = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if cfg.gpu == "on" and ngpu == 0:
        raise RuntimeError("retrieval.index.gpu is 'on' but faiss sees no GPU "
                           "(is faiss-gpu installed and CUDA_VISIBLE_DEVICES set?)")
    if ngpu > 0 and cfg.gpu != "off":
        co = faiss.GpuMultipleClonerOptions()
        co.shard, co.useFloat16 = True, True  # 21M x 768 fp16 = 32 GB over all GPUs
        log.info("sharding the index over %d GPUs (fp16)", ngpu)
        index = faiss.index_cpu_to_all_gpus(index, co=co)
    return index


def read_meta(index_path: str | Path) -> dict:
    p = meta_path(index_path)
    return json.loads(p.read_text()) if p.exists() else {}
