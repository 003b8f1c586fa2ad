"""Dense and BM25 retrievers, passage formatting, and first-hop recall."""

import json

import pytest

from a2tgpo.retrieval.base import Hit
from a2tgpo.retrieval.docstore import DocStore
from a2tgpo.retrieval.evaluate import first_hop_recall, load_world_questions
from a2tgpo.retrieval.index import IndexConfig, build_index, encode_shard, load_index
from a2tgpo.retrieval.retriever import BM25Config, BM25Retriever, DenseRetriever, format_passages

H1 = Hit("7", '"Veaora"\nVeaora is a country. The capital of Veaora is Stuton.', 0.9)
H2 = Hit("8", '"Stuton"\nStuton is a city.', 0.5)


def test_a2tgpo_format_dedups_numbers_and_truncates():
    text = format_passages([H1, H1, H2], "a2tgpo", max_chars=20)
    # the duplicate is dropped before numbering; each passage keeps its first 20 characters:
    # '"Veaora"' (8) + newline (9) + 'Veaora is a' (20)
    assert text == 'Page 1: "Veaora"\nVeaora is a\nPage 2: "Stuton"\nStuton is a'
    assert format_passages([], "a2tgpo") == "No search results found."


def test_search_r1_format():
    assert format_passages([H1, H2], "search_r1") == (
        "Doc 1(Title: Veaora) Veaora is a country. The capital of Veaora is Stuton.\n"
        "Doc 2(Title: Stuton) Stuton is a city.\n"
    )
    assert format_passages([], "search_r1") == ""


def test_docstore_rows(world_dir):
    docs = DocStore(world_dir / "corpus.jsonl")
    lines = [json.loads(line) for line in (world_dir / "corpus.jsonl").open()]
    assert len(docs) == len(lines)
    assert docs.get([3, 0]) == [lines[3], lines[0]]
    assert [c for ch in docs.contents(0, len(docs), chunk=7) for c in ch] == \
        [r["contents"] for r in lines]


def test_docstore_rejects_other_formats(tmp_path):
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"id": "0", "text": "x"}\n')
    with pytest.raises(ValueError, match="need 'id' and 'contents'"):
        DocStore(bad)


@pytest.fixture(scope="module")
def dense(world_dir, encoder, tmp_path_factory):
    d = tmp_path_factory.mktemp("dense")
    docs = DocStore(world_dir / "corpus.jsonl")
    cfg = IndexConfig(num_shards=1)
    encode_shard(docs, encoder, 0, 1, d / "s.npy", 100)
    build_index([d / "s.npy"], cfg, len(docs), d / "i.faiss", {})
    return DenseRetriever(encoder, load_index(d / "i.faiss", cfg, len(docs)), docs)


@pytest.fixture(scope="module")
def bm25(world_dir):
    return BM25Retriever(DocStore(world_dir / "corpus.jsonl"), BM25Config())


@pytest.mark.parametrize("kind", ["dense", "bm25"])
def test_title_query_finds_its_passage(kind, dense, bm25, world_dir):
    retriever = dense if kind == "dense" else bm25
    lines = [json.loads(line) for line in (world_dir / "corpus.jsonl").open()][:30]
    titles = [r["contents"].split("\n")[0].strip('"') for r in lines]
    hits = retriever.search(titles, 3)
    assert len(hits) == 30 and all(len(h) == 3 for h in hits)
    assert all(h[0].score >= h[1].score >= h[2].score for h in hits)
    # an entity's name retrieves its own passage first (names are unique in the world)
    assert sum(h[0].id == r["id"] for h, r in zip(hits, lines, strict=True)) >= 28
    assert retriever.search([], 3) == []


def test_recall_by_hand():
    class Fixed:
        """Returns passage ids from a table, so recall can be counted by hand."""

        def search(self, queries, topk):
            table = {"a": ["1", "2", "3"], "b": ["9", "8", "4"], "c": ["5", "6", "7"]}
            return [[Hit(i, "", 0.0) for i in table[q][:topk]] for q in queries]

    qs = [{"question": q, "dataset": "d", "split": "s",
           "metadata": {"support": [t], "hop_type": h}}
          for q, t, h in [("a", "1", "single"), ("b", "4", "single"), ("c", "0", "bridge")]]
    r = first_hop_recall(Fixed(), qs, (1, 3), batch_size=2)
    # a: target at rank 0; b: at rank 2; c: absent -> recall@1 = 1/3, recall@3 = 2/3
    assert r["recall"] == {"1": 1 / 3, "3": 2 / 3}
    assert r["by_hop_type"]["single"]["recall"] == {"1": 0.5, "3": 1.0}
    assert r["by_hop_type"]["bridge"] == {"n": 1, "recall": {"1": 0.0, "3": 0.0}}


def test_first_hop_recall_on_the_small_world(dense, bm25, world_dir):
    qs = load_world_questions(world_dir)
    for retriever in (dense, bm25):
        r = first_hop_recall(retriever, qs, (3,))
        assert r["by_hop_type"]["single"]["recall"]["3"] >= 0.9
