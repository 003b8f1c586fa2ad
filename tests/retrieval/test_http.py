"""HTTP retriever: Search-R1's wire format, request batching, and the client's failure handling.

Every server here listens on 127.0.0.1 only: the real app under uvicorn in a thread, plus tiny
stdlib servers that misbehave on purpose (slow, 503, malformed).
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import requests
import uvicorn

from a2tgpo.config import ConfigError, from_dict
from a2tgpo.retrieval.base import Hit
from a2tgpo.retrieval.http import (
    HttpConfig,
    HttpRetriever,
    RetrieverError,
    RetrieverUnavailable,
    _Batcher,
    build_app,
    server_config,
)

REPO = Path(__file__).resolve().parents[2]


class FakeRetriever:
    """Deterministic hits derived from the query text; records every call; "boom" raises."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int]] = []
        self.delay_s = 0.0
        self._lock = threading.Lock()

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        with self._lock:
            self.calls.append((list(queries), topk))
        time.sleep(self.delay_s)
        if "boom" in queries:
            raise RuntimeError("index exploded")
        return [expected_hits(q, topk) for q in queries]

    def close(self) -> None:
        pass


def expected_hits(query: str, topk: int) -> list[Hit]:
    return [Hit(f"{query}#{r}", f'"{query}"\npassage {r}', 1.0 / (r + 1)) for r in range(topk)]


def _serve_in_thread(app, **settings):
    """Run `app` under uvicorn with `serve`'s settings (`server_config`) on an ephemeral
    127.0.0.1 port; return (server, thread, url)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, log_level="warning", **settings))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def served():
    """One real server for the module: default topk 3, batches of at most 8 queries."""
    fake = FakeRetriever()
    app = build_app(fake, default_topk=3, max_batch=8, max_wait_ms=20.0,
                    max_request_queries=50, max_topk=10, max_body_bytes=4000,
                    max_query_chars=100)
    server, thread, base = _serve_in_thread(app)
    yield fake, base
    server.should_exit = True
    thread.join(10)
    assert not thread.is_alive()


@pytest.fixture
def fake(served):
    fake, _ = served
    fake.calls.clear()
    fake.delay_s = 0.0
    return fake


@pytest.fixture
def base(served, fake):
    return served[1]


# --------------------------------------------------------------------------------------------
# server: wire format


def test_request_limits_refuse_before_searching(base, fake):
    post = lambda body: requests.post(f"{base}/retrieve", json=body, timeout=5)  # noqa: E731
    r = post({"queries": ["q"] * 51})                      # 51 > max_request_queries 50
    assert r.status_code == 413 and "max_request_queries" in r.json()["detail"]
    r = post({"queries": ["q"], "topk": 11})               # 11 > max_topk 10
    assert r.status_code == 422 and "max_topk" in r.json()["detail"]
    r = post({"queries": ["x" * 4000]})                    # a body over 4000 bytes
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
    assert fake.calls == []                                # none reached the retriever
    assert post({"queries": ["q"] * 50, "topk": 10}).status_code == 200  # at the limits


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def _response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket timeout: 5 s)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _one_response(sock: socket.socket) -> bytes:
    """One whole response (head and its Content-Length of body), leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    size = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")))
    while len(body) < size:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _chunked_head(path: str = "/retrieve") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_a_chunked_body_is_counted_as_it_arrives(base, fake):
    """A chunked body declares no Content-Length. One under the limit is served; one over it
    gets 413 at the chunk that passes 4000 bytes, and the connection is closed without
    waiting for the rest (the client has not even ended the body)."""
    body = json.dumps({"queries": ["q"], "topk": 1}).encode()
    with socket.create_connection(("127.0.0.1", _port(base)), timeout=5) as s:
        s.sendall(_chunked_head() + _chunk(body[:5]) + _chunk(body[5:]) + b"0\r\n\r\n")
        reply = _one_response(s)
    assert reply.startswith(b"HTTP/1.1 200 ") and b'"q#0"' in reply
    fake.calls.clear()

    start = b'{"queries": ["' + b"x" * 986  # 1000 bytes
    with socket.create_connection(("127.0.0.1", _port(base)), timeout=5) as s:
        s.sendall(_chunked_head() + _chunk(start))
        for _ in range(4):  # 1000 + 4 x 1000 = 5000 bytes > 4000; no last chunk follows
            s.sendall(_chunk(b"x" * 1000))
        reply = _response(s)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"connection: close" in reply.lower()
    assert b"max_body_bytes" in reply and b"at least" in reply
    assert fake.calls == []


def test_a_query_over_max_query_chars_is_refused_and_the_client_cuts_it(base, fake, caplog):
    post = lambda body: requests.post(f"{base}/retrieve", json=body, timeout=5)  # noqa: E731
    r = post({"queries": ["q", "x" * 101]})  # 101 > max_query_chars 100
    assert r.status_code == 422
    assert r.json()["detail"] == ("query 1 has 101 characters; the server takes at most 100 "
                                  "(retrieval.http.max_query_chars)")
    assert fake.calls == []
    assert post({"queries": ["x" * 100]}).status_code == 200  # at the limit
    fake.calls.clear()
    client = HttpRetriever(f"{base}/retrieve", max_query_chars=100)
    with caplog.at_level(logging.WARNING, logger="a2tgpo.retrieval.http"):
        hits = client.search(["y" * 250, "short"], topk=1)
    assert [h[0].id for h in hits] == ["y" * 100 + "#0", "short#0"]
    assert fake.calls == [(["y" * 100, "short"], 1)] and client.cut_queries == 1
    assert "a query of 250 characters cut to 100" in caplog.text


def test_health(base):
    assert requests.get(f"{base}/health", timeout=5).json() == {"status": "ok"}


def test_response_shape_with_scores(base):
    body = {"queries": ["a", "b"], "topk": 2, "return_scores": True}
    r = requests.post(f"{base}/retrieve", json=body, timeout=5)
    assert r.status_code == 200
    assert r.json() == {
        "result": [
            [
                {"document": {"id": "a#0", "contents": '"a"\npassage 0'}, "score": 1.0},
                {"document": {"id": "a#1", "contents": '"a"\npassage 1'}, "score": 0.5},
            ],
            [
                {"document": {"id": "b#0", "contents": '"b"\npassage 0'}, "score": 1.0},
                {"document": {"id": "b#1", "contents": '"b"\npassage 1'}, "score": 0.5},
            ],
        ]
    }


def test_response_shape_without_scores_and_default_topk(base, fake):
    # Search-R1's defaults: topk absent -> the server's default (3), return_scores false.
    r = requests.post(f"{base}/retrieve", json={"queries": ["q"]}, timeout=5)
    assert r.status_code == 200
    assert r.json() == {
        "result": [[{"id": f"q#{i}", "contents": f'"q"\npassage {i}'} for i in range(3)]]
    }
    r = requests.post(f"{base}/retrieve", json={"queries": ["q"], "topk": None}, timeout=5)
    assert len(r.json()["result"][0]) == 3
    assert [topk for _, topk in fake.calls] == [3, 3]


def test_empty_queries_give_empty_result_without_search(base, fake):
    r = requests.post(f"{base}/retrieve", json={"queries": [], "topk": 2}, timeout=5)
    assert r.status_code == 200 and r.json() == {"result": []}
    assert fake.calls == []


@pytest.mark.parametrize(
    "body, field",
    [
        ({"queries": ["a"], "topk": 0}, "topk"),
        ({"queries": "a"}, "queries"),
        ({"topk": 2}, "queries"),
        ({"queries": [1, 2]}, "queries"),
    ],
)
def test_bad_request_is_422_naming_the_field(base, fake, body, field):
    r = requests.post(f"{base}/retrieve", json=body, timeout=5)
    assert r.status_code == 422
    assert any(field in err["loc"] for err in r.json()["detail"]), r.json()
    assert fake.calls == []


# --------------------------------------------------------------------------------------------
# server: batching


def test_concurrent_requests_are_batched_and_each_gets_its_own_slice(base, fake):
    # The slow retriever makes requests pile up while a batch is being searched.
    fake.delay_s = 0.05
    n = 16
    barrier = threading.Barrier(n)
    results: dict[int, object] = {}

    def one(i: int) -> None:
        barrier.wait()
        topk = 1 + i % 3
        r = requests.post(
            f"{base}/retrieve",
            json={"queries": [f"q{i}"], "topk": topk, "return_scores": True},
            timeout=10,
        )
        results[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)

    for i in range(n):
        status, body = results[i]
        assert status == 200
        want = [
            {"document": {"id": h.id, "contents": h.contents}, "score": h.score}
            for h in expected_hits(f"q{i}", 1 + i % 3)
        ]
        assert body == {"result": [want]}
    seen = [q for queries, _ in fake.calls for q in queries]
    assert sorted(seen) == sorted(f"q{i}" for i in range(n))  # every query searched once
    assert len(fake.calls) < n  # batched
    assert all(len(queries) <= 8 for queries, _ in fake.calls)  # max_batch honoured
    for queries, topk in fake.calls:  # one search per batch, with the batch's largest topk
        assert topk == max(1 + int(q[1:]) % 3 for q in queries)


def test_retriever_error_fails_its_batch_with_500_then_server_keeps_serving(base, fake):
    r = requests.post(f"{base}/retrieve", json={"queries": ["boom"]}, timeout=5)
    assert r.status_code == 500
    assert "index exploded" in r.json()["detail"]
    r = requests.post(f"{base}/retrieve", json={"queries": ["fine"], "topk": 1}, timeout=5)
    assert r.status_code == 200
    assert r.json()["result"][0][0]["id"] == "fine#0"


def test_one_bad_request_in_a_batch_fails_alone(base, fake):
    # 20 innocent requests and one the retriever cannot search ("boom") arrive together and are
    # merged into batches of 8 queries: the batch holding "boom" fails, is served again one
    # request at a time, and only "boom" gets an error
    fake.delay_s = 0.05
    names = [f"ok{i}" for i in range(20)] + ["boom"]
    barrier = threading.Barrier(len(names))
    status: dict[str, int] = {}

    def one(name: str) -> None:
        barrier.wait()
        r = requests.post(f"{base}/retrieve", json={"queries": [name], "topk": 1}, timeout=20)
        status[name] = r.status_code
        if r.status_code == 200:
            assert r.json()["result"][0][0]["id"] == f"{name}#0"

    threads = [threading.Thread(target=one, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert status.pop("boom") == 500
    assert status == {n: 200 for n in names[:-1]}  # 0 innocent failures
    # "boom" was merged with others at first (the batch failed), then searched alone
    assert any("boom" in qs and len(qs) > 1 for qs, _ in fake.calls), fake.calls
    assert (["boom"], 1) in fake.calls


class GatedFake(FakeRetriever):
    """FakeRetriever whose searches wait for `gate`: requests queue up behind the first search
    in a known order, whatever the timing."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()  # a search has started

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        return super().search(queries, topk)


@pytest.fixture
def gated():
    """A batch worker of at most 8 queries per search over a GatedFake (gate closed)."""
    fake = GatedFake()
    batcher = _Batcher(fake, max_batch=8, max_wait_s=0.01)
    batcher.start()
    yield fake, batcher
    fake.gate.set()
    batcher.stop(5)


def big(n: int) -> list[str]:
    return [f"L{i}" for i in range(n)]


def test_a_request_over_max_batch_is_served_in_pieces_as_if_unsplit(base, fake):
    queries = big(20)
    body = {"queries": queries, "topk": 2, "return_scores": True}
    r = requests.post(f"{base}/retrieve", json=body, timeout=10)
    assert r.status_code == 200
    unsplit = FakeRetriever().search(queries, 2)  # one search of all 20
    assert r.json()["result"] == [
        [{"document": {"id": h.id, "contents": h.contents}, "score": h.score} for h in hs]
        for hs in unsplit
    ]
    # max_batch 8: 20 = 8 + 8 + 4, searched in query order
    assert [qs for qs, _ in fake.calls] == [queries[:8], queries[8:16], queries[16:]]


def test_a_small_request_is_served_between_a_large_ones_pieces(gated):
    fake, batcher = gated
    large = batcher.submit(big(20), 1)
    small = batcher.submit(["s"], 3)  # queued while the large request's first piece is searched
    fake.gate.set()
    # piece 1 fills a batch (8); the rest of the large request goes behind "s", whose batch it
    # fills (1 + 7); the last piece is the other 20 - 8 - 7 = 5 queries
    assert large.result(10) == FakeRetriever().search(big(20), 1)
    assert small.result(10) == [expected_hits("s", 3)]
    assert fake.calls == [(big(8), 1), (["s"] + big(15)[8:], 3), (big(20)[15:], 1)]
    calls = [qs for qs, _ in fake.calls]
    assert calls.index(next(c for c in calls if "s" in c)) < \
        calls.index(next(c for c in calls if "L19" in c))


def test_a_failing_piece_fails_its_request_alone_and_its_rest_is_not_searched(gated):
    fake, batcher = gated
    queries = big(20)
    queries[10] = "boom"  # in the second piece (queries 8-13, after "a" and "b")
    large = batcher.submit(queries, 1)
    a, b = batcher.submit(["a"], 1), batcher.submit(["b"], 2)
    fake.gate.set()
    with pytest.raises(RuntimeError, match="index exploded"):
        large.result(10)
    assert a.result(10) == [expected_hits("a", 1)] and b.result(10) == [expected_hits("b", 2)]
    # the merged batch failed; each piece alone: "a", "b" succeed, the large request's piece
    # fails, and its last 6 queries are never searched
    assert [qs for qs, _ in fake.calls] == [
        queries[:8], ["a", "b"] + queries[8:14], ["a"], ["b"], queries[8:14]]
    assert batcher.submit(["after"], 1).result(10) == [expected_hits("after", 1)]


def test_stop_with_pieces_pending_serves_every_queued_request(gated):
    fake, batcher = gated
    large = batcher.submit(big(20), 2)
    small = batcher.submit(["s"], 1)
    batcher.stop(timeout_s=0.1)  # the worker is blocked in the first piece's search: returns
    with pytest.raises(RuntimeError, match="not running"):
        batcher.submit(["late"], 1)
    fake.gate.set()
    done, not_done = wait([large, small], timeout=10)
    assert not not_done
    assert large.result() == FakeRetriever().search(big(20), 2)
    assert small.result() == [expected_hits("s", 1)]
    # pieces of the large request were still queued after the stop, and were searched
    assert [qs for qs, _ in fake.calls] == [big(8), ["s"] + big(15)[8:], big(20)[15:]]
    batcher.stop(5)  # stop again: waits for the worker, which has ended
    assert not batcher.running


def test_a_cancelled_large_request_is_not_searched_further(gated):
    fake, batcher = gated
    large = batcher.submit(big(20), 1)
    assert fake.entered.wait(10)
    assert large.cancel()  # between pieces the request can still be cancelled
    fake.gate.set()
    assert batcher.submit(["s"], 1).result(10) == [expected_hits("s", 1)]
    assert [qs for qs, _ in fake.calls] == [big(8), ["s"]]


def test_a_query_that_is_not_text_is_refused_before_the_batch(base, fake):
    # JSON may carry a lone surrogate ("\ud800"); no tokenizer takes it
    body = '{"queries": ["fine", "bad \\ud800 query"], "topk": 1}'
    r = requests.post(f"{base}/retrieve", data=body,
                      headers={"Content-Type": "application/json"}, timeout=5)
    assert r.status_code == 422 and "query 1 is not valid text" in r.json()["detail"]
    assert fake.calls == []


# --------------------------------------------------------------------------------------------
# client against the real server


def test_client_round_trip_and_chunking(base, fake):
    client = HttpRetriever(f"{base}/retrieve", max_batch_queries=4)
    queries = [f"x{i}" for i in range(10)]
    try:
        hits = client.search(queries, topk=2)
        assert client.search([], topk=2) == []
    finally:
        client.close()
    assert hits == [expected_hits(q, 2) for q in queries]
    # Sent sequentially in chunks of <= 4, so the server sees exactly these three searches.
    assert [len(q) for q, _ in fake.calls] == [4, 4, 2]
    assert [q for batch, _ in fake.calls for q in batch] == queries


# --------------------------------------------------------------------------------------------
# client failure handling, against stdlib servers that misbehave on purpose


class Scripted:
    """A 127.0.0.1 http.server answering POSTs from a script of (status, body) or "sleep"."""

    def __init__(self, script: list, sleep_s: float = 0.0) -> None:
        self.script = list(script)
        self.requests = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests += 1
                step = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                if step == "sleep":
                    time.sleep(sleep_s)
                    step = (200, {"result": [[]]})
                status, body = step
                data = (body if isinstance(body, str) else json.dumps(body)).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and hung up, as intended

            def log_message(self, *args) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    def __enter__(self) -> Scripted:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _attempt_warnings(caplog) -> int:
    return sum("attempt" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_nothing_listening_raises_unavailable_after_exactly_retries_attempts(caplog):
    # A bound but not listening socket: connections are refused, and no one else can take it.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/retrieve"
        client = HttpRetriever(url, timeout_s=2.0, retries=3, backoff_s=0.05)
        caplog.set_level(logging.WARNING, logger="a2tgpo.retrieval.http")
        start = time.monotonic()
        with pytest.raises(RetrieverUnavailable) as err:
            client.search(["q"], topk=1)
        elapsed = time.monotonic() - start
    msg = str(err.value)
    assert url in msg and "3 attempts" in msg and "serve-retriever" in msg
    assert "ConnectionError" in msg
    assert _attempt_warnings(caplog) == 3
    assert 0.15 <= elapsed < 2.0  # backoff 0.05 s then 0.1 s, and no connect hangs


def test_slow_server_times_out_then_clear_error_in_bounded_time(caplog):
    caplog.set_level(logging.WARNING, logger="a2tgpo.retrieval.http")
    with Scripted(["sleep"], sleep_s=1.0) as srv:
        client = HttpRetriever(srv.url, timeout_s=0.2, retries=2, backoff_s=0.01)
        start = time.monotonic()
        with pytest.raises(RetrieverUnavailable) as err:
            client.search(["q"], topk=1)
        elapsed = time.monotonic() - start
        assert srv.requests == 2
    assert "Timeout" in str(err.value) and "timeout 0.2 s" in str(err.value)
    assert _attempt_warnings(caplog) == 2
    assert 0.4 <= elapsed < 1.5


def test_503_then_200_succeeds_on_retry():
    ok = {"result": [[{"document": {"id": "7", "contents": "c"}, "score": 0.25}]]}
    with Scripted([(503, {"detail": "warming up"}), (200, ok)]) as srv:
        client = HttpRetriever(srv.url, retries=3, backoff_s=0.01)
        assert client.search(["q"], topk=1) == [[Hit("7", "c", 0.25)]]
        assert srv.requests == 2


def test_500_every_time_names_the_status_and_detail():
    with Scripted([(500, {"detail": "gpu on fire"})]) as srv:
        client = HttpRetriever(srv.url, retries=2, backoff_s=0.01)
        with pytest.raises(RetrieverUnavailable, match="HTTP 500.*gpu on fire"):
            client.search(["q"], topk=1)
        assert srv.requests == 2


def test_4xx_is_not_retried():
    with Scripted([(422, {"detail": "bad topk"})]) as srv:
        client = HttpRetriever(srv.url, retries=3, backoff_s=0.01)
        with pytest.raises(RetrieverError, match="HTTP 422.*bad topk") as err:
            client.search(["q"], topk=1)
        assert not isinstance(err.value, RetrieverUnavailable)
        assert srv.requests == 1


@pytest.mark.parametrize(
    "body, match",
    [
        ({"result": [[], []]}, r"one list per query \(1\), got 2 lists"),
        ({"results": [[]]}, "one list per query"),
        ("not json", "not JSON"),
        ({"result": [{"id": "1"}]}, r"result\[0\] is not a list"),
        ({"result": [[{"id": "1", "contents": "c"}]]}, r"result\[0\]\[0\] is not"),
    ],
)
def test_malformed_response_is_a_clear_error(body, match):
    with Scripted([(200, body)]) as srv:
        with pytest.raises(RetrieverError, match=match):
            HttpRetriever(srv.url, retries=3).search(["q"], topk=1)
        assert srv.requests == 1


def test_search_r1_documents_extra_fields_and_missing_id_are_tolerated():
    # Search-R1's BM25 path yields {"title", "text", "contents"} with no id; scores may be ints.
    body = {
        "result": [
            [
                {"document": {"title": "T", "text": "x", "contents": '"T"\nx'}, "score": 3},
                {"document": {"id": 12, "contents": "c", "extra": 1}, "score": 0.5, "rank": 2},
            ]
        ],
        "took_ms": 3,
    }
    with Scripted([(200, body)]) as srv:
        hits = HttpRetriever(srv.url).search(["q"], topk=2)
    assert hits == [[Hit("", '"T"\nx', 3.0), Hit("12", "c", 0.5)]]
    assert hits[0][0].title == "T"


# --------------------------------------------------------------------------------------------
# config and serve()


def test_http_config_defaults_and_validation():
    cfg = from_dict(HttpConfig, {})
    assert (cfg.url, cfg.host, cfg.port) == ("http://127.0.0.1:8000/retrieve", "127.0.0.1", 8000)
    assert (cfg.max_batch, cfg.max_wait_ms, cfg.max_batch_queries) == (256, 5.0, 512)
    assert (cfg.max_query_chars, cfg.keep_alive_s, cfg.request_timeout_s) == (4096, 5.0, 30.0)
    with pytest.raises(ConfigError, match="retries"):
        from_dict(HttpConfig, {"retries": 0})
    for key, value in (("max_query_chars", 0), ("keep_alive_s", 0.0),
                       ("request_timeout_s", float("inf"))):
        with pytest.raises(ConfigError, match=key):
            from_dict(HttpConfig, {key: value})
    with pytest.raises(ConfigError, match="url"):
        from_dict(HttpConfig, {"url": "127.0.0.1:8000/retrieve"})


@pytest.fixture(scope="module")
def strict():
    """(FakeRetriever, port) of a server that gives a client 1 s to send a whole request and
    keeps an idle connection 1 s."""
    fake = FakeRetriever()
    app = build_app(fake, default_topk=1, max_batch=8, max_wait_ms=1.0)
    server, thread, base = _serve_in_thread(app, request_timeout_s=1.0, keep_alive_s=1.0)
    yield fake, _port(base)
    server.should_exit = True
    thread.join(10)


def _closed_after(port: int, parts: list[bytes], pause_s: float = 0.0,
                  before: bytes = b"") -> float:
    """Connect, send the whole request `before` (if any) and read its answer, then send
    `parts` `pause_s` apart and wait for the server to close the connection; the seconds from
    the start of `parts` to the close (socket timeout 5 s: a server that never closes fails
    the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if before:
            s.sendall(before)
            assert _one_response(s).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        try:
            for part in parts:
                s.sendall(part)
                time.sleep(pause_s)
            _response(s)
        except (BrokenPipeError, ConnectionResetError):  # closed while we were sending
            pass
        return time.monotonic() - start


def test_silent_and_half_sent_connections_are_closed_at_the_request_timeout(strict):
    """request_timeout_s 1: a connection that sends nothing, half a head, a head and half its
    body, or a head one byte every 0.3 s (each byte well inside any per-read timeout), is
    closed about 1 s after it opened; after a whole request and its answer, one that sends
    half a second request about 1 s after it began, and one that stays idle after
    keep_alive_s (1 s)."""
    fake, port = strict
    head = b"POST /retrieve HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    body = json.dumps({"queries": ["q"]}).encode()
    whole = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    cases = {
        "silent": ([], 0.0, b""),
        "half a head": ([head], 0.0, b""),
        "half a body": ([head + b"Content-Length: 100\r\n\r\n" + body[:10]], 0.0, b""),
        "a byte at a time": ([bytes([b]) for b in head], 0.3, b""),
        "half a second request": ([head], 0.0, whole),
        "idle after a request": ([], 0.0, whole),
    }
    with ThreadPoolExecutor(len(cases)) as pool:  # all at once: the test takes ~1 s
        waits = {name: pool.submit(_closed_after, port, *case) for name, case in cases.items()}
        seconds = {name: w.result() for name, w in waits.items()}
    for name, s in seconds.items():
        assert 0.9 < s < 2.5, (name, seconds)
    assert sorted(q for qs, _ in fake.calls for q in qs) == ["q", "q"]  # the whole requests


def test_the_request_timeout_does_not_cut_a_slow_search(strict):
    """The clock stops once the request is in whole: a search of 1.5 s (over the 1 s request
    timeout) is answered."""
    fake, port = strict
    fake.delay_s = 1.5
    try:
        r = requests.post(f"http://127.0.0.1:{port}/retrieve", json={"queries": ["q"]},
                          timeout=5)
    finally:
        fake.delay_s = 0.0
    assert r.status_code == 200 and r.json()["result"][0][0]["id"] == "q#0"


SERVE_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from a2tgpo.retrieval.base import Hit
    from a2tgpo.retrieval.http import serve

    class One:
        def search(self, queries, topk):
            return [[Hit("1", q, 1.0)] for q in queries]
        def close(self):
            pass

    logging.basicConfig(level=logging.INFO)
    serve(One(), port=int(sys.argv[1]), log_level="info",
          ready_file=sys.argv[2] if len(sys.argv) > 2 else None)
    print("serve returned", flush=True)
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_shuts_down_cleanly_on_signal(sig):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "server did not come up within 20 s"
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                time.sleep(0.05)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "serve returned" in out
    assert f"stopped on {signal.Signals(sig).name}" in out


def test_serve_on_port_0_publishes_where_it_listens(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-c", SERVE_SCRIPT, "0", str(ready)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no ready file within 20 s"
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid and info["port"] > 0 and info["host"] == "127.0.0.1"
        assert info["url"] == f"http://127.0.0.1:{info['port']}/retrieve"
        # the file is written once the server listens: the first request is answered
        hits = HttpRetriever(info["url"], retries=1).search(["q"], topk=1)
        assert [h.contents for h in hits[0]] == ["q"]
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0


def test_the_retry_budget_outlasts_a_server_restart():
    """A server that is down for ~1.5 s (restarting) and then listens: the budget's attempts
    reach it; with `retries` attempts only (budget 0) the client gives up before."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/retrieve"
    quick = HttpRetriever(url, timeout_s=1.0, retries=2, backoff_s=0.1)
    with pytest.raises(RetrieverUnavailable, match="after 2 attempts"):
        quick.search(["q"], topk=1)

    box = {}

    def restart_later():
        time.sleep(1.5)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        app = build_app(FakeRetriever(), default_topk=1, max_batch=8, max_wait_ms=1.0)
        box["server"] = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        box["server"].run(sockets=[sock])

    thread = threading.Thread(target=restart_later, daemon=True)
    thread.start()
    try:
        # backoff 0.1, 0.2, 0.4, 0.8, 1.6 s: the 5th or 6th attempt (1.5-3.1 s) finds it
        patient = HttpRetriever(url, timeout_s=1.0, retries=2, backoff_s=0.1,
                                retry_budget_s=10.0)
        assert patient.search(["q"], topk=1)[0][0].id == "q#0"
    finally:
        deadline = time.monotonic() + 5
        while "server" not in box and time.monotonic() < deadline:
            time.sleep(0.05)
        if "server" in box:
            box["server"].should_exit = True
        thread.join(10)
