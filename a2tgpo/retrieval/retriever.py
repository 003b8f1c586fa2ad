"""Retrievers behind one interface (`a2tgpo.retrieval.base.Retriever`), and how passages are
shown to the policy.

* `DenseRetriever`: encoder + faiss index + corpus store (Search-R1's e5 setup; MiniLM on the toy);
* `BM25Retriever`: `bm25s` over the same corpus;
* `HttpRetriever` (a2tgpo.retrieval.http): a client for our server or any Search-R1 server.

`format_passages` renders hits per prompt style (algorithms.md §10.4): A2TGPO/AT2PO's
deduplicated `Page i: ...` list (each passage cut to 1000 characters) or Search-R1's
`Doc i(Title: ...) ...` lines; an empty result has its own text.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from a2tgpo.config import option
from a2tgpo.data.prompts import A2TGPO_EMPTY_RESULT, PromptStyle
from a2tgpo.retrieval.base import Hit, HttpConfig, Retriever
from a2tgpo.retrieval.encoders import Encoder, EncoderConfig
from a2tgpo.retrieval.index import IndexConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BM25Config:
    """BM25 settings (bm25s), used when retrieval.retriever is bm25."""

    k1: float = option(1.5, "Term-frequency saturation.", ge=0)
    b: float = option(0.75, "Length normalisation.", ge=0, le=1)
    method: Literal["lucene", "robertson", "atire"] = option("lucene", "BM25 variant.")
    stopwords: str = option("en", "Stopword list name for bm25s.tokenize ('' = none).")


@dataclass(frozen=True)
class RetrievalConfig:
    """The search tool: which retriever, where it runs, and its index (study section)."""

    retriever: Literal["dense", "bm25"] = option(
        "dense", "dense = encoder + faiss (the papers' e5 setup); bm25 = bm25s."
    )
    mode: Literal["inprocess", "http"] = option(
        "inprocess", "inprocess = load the retriever in the rollout process; http = call a "
        "server (ours from `a2tgpo serve-retriever`, or an existing Search-R1 server).",
    )
    topk: int = option(
        3, "Passages per search call (the papers use 3): what every rollout (training, "
        "validation, evaluation, the toy's warm-start demonstrations) is shown, the server's "
        "default for a request without topk, and `a2tgpo search`'s.", ge=1)
    max_passage_chars: int = option(
        1000, "A2TGPO/AT2PO style: each passage is cut to this many characters before the "
        "policy sees it.", ge=1
    )
    encoder: EncoderConfig = option(doc="Dense encoder.", factory=EncoderConfig)
    index: IndexConfig = option(doc="Dense index build and load.", factory=IndexConfig)
    bm25: BM25Config = option(doc="BM25 settings.", factory=BM25Config)
    http: HttpConfig = option(doc="HTTP client and server settings.", factory=HttpConfig)
    eval_k: tuple[int, ...] = option(
        (1, 3, 5), "k values of recall@k reported by `a2tgpo retrieval-eval`.", ge=1
    )

    def __post_init__(self) -> None:
        if self.topk < 1:
            raise ValueError("topk must be >= 1")
        if not self.eval_k or min(self.eval_k) < 1:
            raise ValueError("eval_k must hold values >= 1")
        if self.mode == "http" and self.topk > self.http.max_topk:
            # our server (a job's own with http.serve job) refuses every such request (HTTP
            # 422): the first search of step 0 would fail
            raise ValueError(f"topk {self.topk} is over http.max_topk {self.http.max_topk}, "
                             "the largest topk the retrieval server accepts: raise "
                             "http.max_topk or lower topk")


class DenseRetriever:
    """Encoder + faiss: faiss ids are corpus row numbers, looked up in the DocStore."""

    def __init__(self, encoder: Encoder, index, docs):
        if index.d != encoder.dim:
            from a2tgpo.retrieval.index import IndexMismatch

            raise IndexMismatch(f"index dimension {index.d} != encoder dimension {encoder.dim}: "
                                "the index was built with another encoder")
        self.encoder, self.index, self.docs = encoder, index, docs

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if not queries:
            return []
        q = self.encoder.encode(queries, "query")  # (Q, D)
        scores, rows = self.index.search(q, topk)  # (Q, k) each; row -1 = fewer hits
        return _hits(self.docs, scores, rows)

    def close(self) -> None:
        pass


class BM25Retriever:
    """bm25s over the corpus contents (titles included, as Search-R1's BM25 index does)."""

    def __init__(self, docs, cfg: BM25Config):
        import bm25s

        self.docs, self.cfg = docs, cfg
        corpus = [c for chunk in docs.contents(0, len(docs), chunk=100_000) for c in chunk]
        tokens = bm25s.tokenize(corpus, stopwords=cfg.stopwords or None, show_progress=False)
        self.model = bm25s.BM25(k1=cfg.k1, b=cfg.b, method=cfg.method)
        self.model.index(tokens, show_progress=False)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        import bm25s

        if not queries:
            return []
        tokens = bm25s.tokenize(queries, stopwords=self.cfg.stopwords or None,
                                show_progress=False)
        k = min(topk, len(self.docs))
        rows, scores = self.model.retrieve(tokens, k=k, show_progress=False)  # (Q, k) each
        return _hits(self.docs, scores, rows)

    def close(self) -> None:
        pass


def _hits(docs, scores: np.ndarray, rows: np.ndarray) -> list[list[Hit]]:
    flat = sorted({int(r) for r in rows.ravel() if r >= 0})
    by_row = dict(zip(flat, docs.get(flat), strict=True))
    return [
        [Hit(by_row[int(r)]["id"], by_row[int(r)]["contents"], float(s))
         for r, s in zip(rr, ss, strict=True) if r >= 0]
        for rr, ss in zip(rows, scores, strict=True)
    ]


def format_passages(hits: list[Hit], style: PromptStyle, max_chars: int = 1000) -> str:
    """The text of one search result as the policy sees it (inside <result>/<information>)."""
    if style == "a2tgpo":
        seen, pages = set(), []
        for h in hits:
            if h.contents in seen:  # the released tool drops repeated passages
                continue
            seen.add(h.contents)
            pages.append(f"Page {len(pages) + 1}: {h.contents[:max_chars]}")
        return "\n".join(pages) if pages else A2TGPO_EMPTY_RESULT
    # Search-R1 `_passages2string`: title = first line of contents, text = the rest
    return "".join(f"Doc {i + 1}(Title: {h.title}) {h.text}\n" for i, h in enumerate(hits))


def build_retriever(cfg: RetrievalConfig, corpus: str | Path, index_path: str | Path | None,
                    cache_dir: str | Path | None = None) -> Retriever:
    """The configured retriever (in-process dense or BM25, or the HTTP client)."""
    if cfg.mode == "http":
        from a2tgpo.ops.sidecar import ENV_URL
        from a2tgpo.retrieval.http import HttpRetriever

        h = cfg.http
        url = os.environ.get(ENV_URL)
        if url:  # the job's own server (`a2tgpo with-retriever`)
            log.info("retrieval: the job's server at %s (%s)", url, ENV_URL)
        elif h.serve == "job":
            raise ValueError(f"retrieval.http.serve is job but {ENV_URL} is not set: run the "
                             "command under `a2tgpo with-retriever CONFIG -- ...`")
        return HttpRetriever(url or h.url, timeout_s=h.timeout_s, retries=h.retries,
                             backoff_s=h.backoff_s, max_batch_queries=h.max_batch_queries,
                             retry_budget_s=h.retry_budget_s, max_query_chars=h.max_query_chars)
    from a2tgpo.retrieval.docstore import DocStore

    docs = DocStore(corpus, cache_dir=cache_dir)
    if cfg.retriever == "bm25":
        return BM25Retriever(docs, cfg.bm25)
    from a2tgpo.retrieval.index import load_index

    if index_path is None:
        raise ValueError("the dense retriever needs an index path")
    return DenseRetriever(Encoder(cfg.encoder), load_index(index_path, cfg.index, len(docs)),
                          docs)
