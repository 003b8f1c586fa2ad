"""The retrieval commands end to end: build, serve over HTTP, search through the client."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from a2tgpo.cli import main
from a2tgpo.retrieval.http import HttpRetriever

A2TGPO = str(Path(sys.executable).parent / "a2tgpo")


@pytest.fixture(scope="module")
def built(world_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    cfg = d / "retrieval.yaml"
    cfg.write_text(yaml.safe_dump({"index": {"num_shards": 2, "chunk_size": 20}}))
    corpus = str(world_dir / "corpus.jsonl")
    for i in range(2):
        assert main(["encode-corpus", str(cfg), "--corpus", corpus, "--shard", str(i),
                     "--out", str(d / f"s{i}.npy")]) == 0
    assert main(["build-index", str(cfg), "--corpus", corpus, "--shards", str(d / "s0.npy"),
                 str(d / "s1.npy"), "--out", str(d / "i.faiss")]) == 0
    return d, cfg, corpus


def test_wrong_shard_count_and_encoder_mismatch(built, capsys):
    d, cfg, corpus = built
    assert main(["build-index", str(cfg), "--corpus", corpus, "--shards", str(d / "s0.npy"),
                 "--out", str(d / "x.faiss")]) == 2
    assert "num_shards is 2 but 1 shard files" in capsys.readouterr().err
    # the index records its encoder; a config asking for another one is refused
    assert main(["search", str(cfg), "encoder.max_length=64", "--corpus", corpus, "--index",
                 str(d / "i.faiss"), "--query", "x"]) == 1
    assert "was built with encoder" in capsys.readouterr().err


def test_corpus_index_mismatch_via_cli(built, tmp_path, capsys):
    d, cfg, corpus = built
    longer = tmp_path / "c.jsonl"
    longer.write_text(Path(corpus).read_text() + '{"id": "x", "contents": "\\"X\\"\\nextra"}\n')
    assert main(["check-index", str(cfg), "--corpus", str(longer), "--index",
                 str(d / "i.faiss"), "--out", str(tmp_path / "c.json")]) == 1
    err = capsys.readouterr().err
    assert "the index holds" in err and "but the corpus has" in err
    assert not (tmp_path / "c.json").exists()


def test_check_index_checks_count_contents_and_alignment(built, tmp_path):
    d, cfg, corpus = built
    out = tmp_path / "check.json"
    assert main(["check-index", str(cfg), "--corpus", corpus, "--index", str(d / "i.faiss"),
                 "--sample-rows", "8", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    n = len(Path(corpus).read_text().splitlines())
    assert record["ntotal"] == record["contents_checked"] == n
    a = record["alignment"]
    assert a["method"] == "reconstruct" and len(a["rows"]) == 8
    assert a["rows"][0] == 0 and a["rows"][-1] == n - 1 and a["min_cosine"] >= 0.99


def test_check_index_refuses_a_shifted_index_of_the_right_size(built, tmp_path, capsys):
    import numpy as np

    from a2tgpo.retrieval.index import IndexConfig, build_index

    d, cfg, corpus = built
    vectors = np.concatenate([np.load(d / "s0.npy"), np.load(d / "s1.npy")])
    np.save(tmp_path / "rolled.npy", np.roll(vectors, 1, axis=0))  # row i holds row i-1's vector
    build_index([tmp_path / "rolled.npy"], IndexConfig(), len(vectors), tmp_path / "r.faiss", {})
    out = tmp_path / "check.json"
    assert main(["check-index", str(cfg), "--corpus", corpus, "--index",
                 str(tmp_path / "r.faiss"), "--sample-rows", "8", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    first_id = json.loads(Path(corpus).read_text().splitlines()[0])["id"]
    assert "index rows do not hold the vectors of the same corpus rows" in err
    # corpus row 0's vector was rolled to index row 1
    assert f"First: row 0 (id {first_id!r}): cosine" in err
    assert "its passage is nearest to index row 1" in err
    assert not out.exists()


def test_check_index_refuses_a_corpus_row_without_contents(built, tmp_path, capsys):
    d, cfg, corpus = built
    rows = Path(corpus).read_text().splitlines()
    rows[4] = json.dumps({"id": json.loads(rows[4])["id"], "contents": None})
    bad = tmp_path / "c.jsonl"
    bad.write_text("\n".join(rows) + "\n")
    out = tmp_path / "check.json"
    # same row count as the index: only the contents check can refuse it
    assert main(["check-index", str(cfg), "--corpus", str(bad), "--index", str(d / "i.faiss"),
                 "--out", str(out)]) == 1
    assert f"{bad} line 5: 'contents' is not a string but null" in capsys.readouterr().err
    assert not out.exists()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_and_search_over_http_equals_in_process(built, world_dir, capsys):
    d, cfg, corpus = built
    port = free_port()
    proc = subprocess.Popen([A2TGPO, "serve-retriever", str(cfg), "--corpus", corpus,
                             "--index", str(d / "i.faiss"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:"
                                                        f"{os.environ['PATH']}"})
    try:
        client = HttpRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=5, retries=1)
        deadline = time.time() + 60
        while True:  # the server needs a few seconds to load the encoder
            try:
                client.search(["warm up"], 1)
                break
            except Exception:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.5)
        qs = [json.loads(line)["question"] for line in
              (world_dir / "qa" / "s" / "test.jsonl").open()][:10]
        remote = client.search(qs, 3)
        assert main(["search", str(cfg), "--corpus", corpus, "--index", str(d / "i.faiss"),
                     *sum([["--query", q] for q in qs[:2]], [])]) == 0
        printed = capsys.readouterr().out
        for hits in remote[:2]:
            assert f"{hits[0].id}={hits[0].score:.3f}" in printed  # same passages, same scores
        assert all(len(h) == 3 for h in remote)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
