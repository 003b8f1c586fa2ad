"""HTTP mode of the retriever: a batching server and a client, both on Search-R1's `/retrieve` API.

Wire format (as in Search-R1's `search_r1/search/retrieval_server.py`, so either side can talk to
the other project's counterpart):

    POST /retrieve  {"queries": [str], "topk": int | null, "return_scores": bool}
      -> {"result": [[{"document": {"id", "contents"}, "score": float}, ...] per query]}
         with return_scores; without it each item is the bare document {"id", "contents"}.

`topk: null` (or absent) means the server's default; `return_scores` defaults to false.

Deviations from Search-R1's server, all on the safe side:
- It binds 0.0.0.0; `serve` binds 127.0.0.1 unless a host is given.
- It treats `topk: 0` as "use the default"; here `topk` must be >= 1 (422 otherwise).
- It runs one retriever call per HTTP request; here concurrent requests are batched into one
  `Retriever.search` call of at most `max_batch` queries by a single worker thread, which also
  keeps a non-thread-safe retriever (faiss on GPU, a torch encoder) on one thread. A request of
  more than `max_batch` queries is searched in pieces that take turns with the other queued
  requests, so a small request does not wait for a large one's whole search.

The client (`HttpRetriever`) is a `Retriever`: the agent loop cannot tell it from an in-process one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import queue
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fastapi
import pydantic
import requests
import uvicorn
from fastapi.responses import JSONResponse

from a2tgpo.retrieval.base import Hit, HttpConfig, Retriever  # noqa: F401 (HttpConfig re-exported)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# server


class RetrieveRequest(pydantic.BaseModel):
    """Search-R1's request body; unknown fields are ignored, as there."""

    queries: list[str]
    topk: int | None = pydantic.Field(default=None, ge=1)
    return_scores: bool = False


@dataclass
class _Pending:
    """One request. A request larger than max_batch is searched in pieces: `served` of its
    queries have been searched so far, their hits (cut to `topk`) gathered in `hits`."""

    queries: list[str]
    topk: int
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    served: int = 0
    hits: list[list[Hit]] = dataclasses.field(default_factory=list)


class _Batcher:
    """One worker thread that owns the retriever and serves queued requests in batches.

    A batch is at most `max_batch` queries. A request of up to `max_batch` queries is searched
    whole; a larger one (with `split`) in pieces: each time it comes to the front of the queue
    it fills the batch's remaining room, and what is left of it goes to the back of the queue
    once that batch is served. Requests queued meanwhile are served in between, so one large
    request holds up a small one for about one batch, not for its whole search. Its future gets
    all pieces' hits, in query order, after the last piece. Without `split` a larger request is
    searched alone in one call.
    """

    def __init__(self, retriever: Retriever, max_batch: int, max_wait_s: float,
                 split: bool = True) -> None:
        self._retriever = retriever
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._split = split
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        # Guards "stopped?" + enqueue, so nothing is queued behind the stop sentinel and lost.
        self._lock = threading.Lock()
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="retrieval-batcher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, serve every one already queued (all pieces), then end the
        worker; waits at most `timeout_s` for it."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("retrieval batch worker still busy after %.0f s; leaving it", timeout_s)

    def submit(self, queries: list[str], topk: int) -> concurrent.futures.Future:
        pending = _Pending(queries, topk)
        with self._lock:
            if self._stopped or not self.running:
                raise RuntimeError("the retrieval batch worker is not running")
            self._queue.put(pending)
        return pending.future

    def _piece(self, p: _Pending, room: int) -> int:
        """How many of `p`'s remaining queries go into a batch with `room` queries free
        (room == max_batch: an empty batch); 0: none, it waits for the next batch whole."""
        left = len(p.queries) - p.served
        if left <= room:
            return left
        if self._split and left > self._max_batch:
            return room
        return left if room == self._max_batch else 0

    def _run(self) -> None:
        held: _Pending | None = None  # took it from the queue, but it did not fit the last batch
        stopping = False
        while True:
            first, held = held, None
            while first is None:
                try:
                    # once stopping, the queue holds only what was submitted before the stop
                    # and this thread's own requeued pieces: drain it without waiting
                    first = self._queue.get_nowait() if stopping else self._queue.get()
                except queue.Empty:
                    return
                stopping = stopping or first is None
            batch = [(first, self._piece(first, self._max_batch))]
            size = batch[0][1]
            deadline = time.monotonic() + self._max_wait_s
            while size < self._max_batch:
                try:
                    item = self._queue.get_nowait() if stopping else self._queue.get(
                        timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                    continue
                n = self._piece(item, self._max_batch - size)
                if n == 0:
                    held = item
                    break
                batch.append((item, n))
                size += n
            for p in self._serve(batch):
                self._queue.put(p)  # the rest of a large request: to the back of the queue

    def _search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        hits = self._retriever.search(queries, topk)
        if len(hits) != len(queries):
            raise RuntimeError(f"retriever returned {len(hits)} hit lists for {len(queries)} "
                               "queries")
        return hits

    def _serve(self, batch: list[tuple[_Pending, int]]) -> list[_Pending]:
        """Search the pieces (request, number of its next queries) of `batch` in one call;
        returns the requests that have pieces left."""
        # Requests whose client went away were cancelled; do not search for them. A request's
        # future is claimed (running, so no longer cancellable) only for its last piece.
        batch = [(p, n) for p, n in batch if (
            p.future.set_running_or_notify_cancel() if p.served + n == len(p.queries)
            else not p.future.cancelled())]
        if not batch:
            return []
        queries = [q for p, n in batch for q in p.queries[p.served : p.served + n]]
        topk = max(p.topk for p, _ in batch)
        start = time.perf_counter()
        try:
            hits = self._search(queries, topk)
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch[0][0], e)
                return []
            # one bad request must not fail the others merged with it: each piece alone, so
            # only the requests whose piece fails get their error
            log.warning("retrieval batch of %d requests failed (%s: %s); serving them one by "
                        "one", len(batch), type(e).__name__, e)
            return [p for p, n in batch if self._serve_alone(p, n)]
        log.debug(
            "retrieval batch: %d requests, %d queries, topk %d, %.1f ms",
            len(batch), len(queries), topk, 1e3 * (time.perf_counter() - start),
        )
        more, offset = [], 0
        for p, n in batch:
            if self._deliver(p, hits[offset : offset + n]):
                more.append(p)
            offset += n
        return more

    def _serve_alone(self, p: _Pending, n: int) -> bool:
        """Search `p`'s next `n` queries on their own; True if `p` has pieces left."""
        try:
            hits = self._search(p.queries[p.served : p.served + n], p.topk)
        except Exception as e:
            self._fail(p, e)
            return False
        return self._deliver(p, hits)

    @staticmethod
    def _deliver(p: _Pending, hits: list[list[Hit]]) -> bool:
        """Add the hits of `p`'s next piece; set its result after the last; True if more."""
        p.hits.extend(h[: p.topk] for h in hits)
        p.served += len(hits)
        if p.served < len(p.queries):
            return True
        p.future.set_result(p.hits)
        return False

    @staticmethod
    def _fail(p: _Pending, e: Exception) -> None:
        """Fail the whole request `p` (its later pieces are not searched) unless cancelled."""
        log.error("retrieval request of %d queries failed at queries %d+: %s: %s",
                  len(p.queries), p.served, type(e).__name__, e, exc_info=e)
        if p.future.running() or p.future.set_running_or_notify_cancel():
            p.future.set_exception(e)


def _not_utf8(queries: list[str]) -> int | None:
    """Index of the first query that is not encodable text (e.g. a lone surrogate, which JSON
    allows as \\ud800 but no tokenizer takes), else None."""
    for i, q in enumerate(queries):
        try:
            q.encode("utf-8")
        except UnicodeEncodeError:
            return i
    return None


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets 413, by its Content-Length
    before any of it is read, and otherwise (a chunked body declares no length) as its bytes
    arrive, at the first chunk past the limit, never holding more than the limit. The 413
    says `Connection: close`, so the rest of the body is not read either."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    def _refuse(self, size: str) -> fastapi.HTTPException:
        return fastapi.HTTPException(
            413, detail=f"request body of {size} bytes is over the server's limit of "
            f"{self.limit} (retrieval.http.max_body_bytes)", headers={"Connection": "close"})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        # compared as text first: int() refuses numbers of more than 4300 digits
        if declared.isdigit() and (len(declared) > 20 or int(declared) > self.limit):
            too_large = self._refuse(declared if len(declared) <= 20 else "more than 10^20")
            response = JSONResponse({"detail": too_large.detail}, status_code=413,
                                    headers=too_large.headers)
            return await response(scope, receive, send)
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # FastAPI passes an HTTPException raised while it reads the body on to
                    # its handler, which answers with it
                    raise self._refuse(f"at least {received}")
            return message

        await self.app(scope, counted, send)


def build_app(
    retriever: Retriever, *, default_topk: int, max_batch: int, max_wait_ms: float,
    max_request_queries: int = 4096, max_topk: int = 100, max_body_bytes: int = 16 * 2**20,
    max_query_chars: int = 4096, split_requests: bool = True,
) -> fastapi.FastAPI:
    """The FastAPI app serving `retriever` on Search-R1's `POST /retrieve`, plus `GET /health`.

    The batch worker runs while the app is served (FastAPI lifespan); the caller keeps ownership
    of `retriever` and closes it. Requests over the limits are refused before they reach the
    batch (413: a body over `max_body_bytes`, by its Content-Length or, chunked, by the bytes
    received; more than `max_request_queries` queries; 422: topk over `max_topk`, a query
    longer than `max_query_chars` characters, a query that is not text). A batch whose search
    fails is served again request by request, so a request that cannot be searched fails
    alone (500) and the others merged with it are answered.

    Concurrent requests are merged into searches of at most `max_batch` queries. A request of
    more than `max_batch` queries is searched in pieces of at most `max_batch`: after each
    piece the rest of it goes to the back of the queue, so requests that arrived meanwhile are
    served before its next piece (a small request waits about one batch, not the large
    request's whole search). Its response holds all pieces' hits in query order; a piece that
    fails fails that request alone, and its later pieces are not searched. At shutdown every
    request already queued is served in full. `split_requests=False` searches a large request
    in one call instead (for comparison).
    """
    if default_topk < 1 or max_batch < 1 or max_wait_ms < 0:
        raise ValueError(
            f"need default_topk >= 1, max_batch >= 1, max_wait_ms >= 0; got {default_topk}, "
            f"{max_batch}, {max_wait_ms}"
        )
    batcher = _Batcher(retriever, max_batch, max_wait_ms / 1e3, split=split_requests)

    @contextlib.asynccontextmanager
    async def lifespan(_: fastapi.FastAPI):
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = fastapi.FastAPI(title="a2tgpo retrieval server", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)

    @app.get("/health")
    def health() -> JSONResponse:
        if batcher.running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "batch worker not running"}, status_code=503)

    @app.post("/retrieve")
    async def retrieve(request: RetrieveRequest) -> JSONResponse:
        if not request.queries:
            return JSONResponse({"result": []})
        if len(request.queries) > max_request_queries:
            return JSONResponse({"detail": f"{len(request.queries)} queries in one request; the "
                                 f"server takes at most {max_request_queries} "
                                 "(retrieval.http.max_request_queries)"}, status_code=413)
        if request.topk is not None and request.topk > max_topk:
            return JSONResponse({"detail": f"topk {request.topk} is over the server's limit of "
                                 f"{max_topk} (retrieval.http.max_topk)"}, status_code=422)
        long = next((i for i, q in enumerate(request.queries) if len(q) > max_query_chars), None)
        if long is not None:
            return JSONResponse({"detail": f"query {long} has {len(request.queries[long])} "
                                 f"characters; the server takes at most {max_query_chars} "
                                 "(retrieval.http.max_query_chars)"}, status_code=422)
        bad = _not_utf8(request.queries)
        if bad is not None:
            return JSONResponse({"detail": f"query {bad} is not valid text (it holds a lone "
                                 "UTF-16 surrogate; encode queries as UTF-8)"}, status_code=422)
        try:
            hits = await asyncio.wrap_future(
                batcher.submit(request.queries, request.topk or default_topk)
            )
        except Exception as e:
            return JSONResponse(
                {"detail": f"retrieval failed: {type(e).__name__}: {e}"}, status_code=500
            )
        if request.return_scores:
            result = [
                [{"document": {"id": h.id, "contents": h.contents}, "score": h.score} for h in hs]
                for hs in hits
            ]
        else:
            result = [[{"id": h.id, "contents": h.contents} for h in hs] for hs in hits]
        return JSONResponse({"result": result})

    return app


@contextlib.contextmanager
def _absorb_signals(received: list[int]) -> Iterator[None]:
    """Record SIGINT/SIGTERM instead of dying on them while uvicorn shuts down.

    uvicorn handles both signals with a graceful shutdown, then re-raises the signal against the
    handlers that were installed before it started. With these recording handlers in place,
    `serve` returns normally and its caller can still close the retriever.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # signals can only be handled on the main thread; uvicorn skips them there too
        return
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda sig, _frame: received.append(sig)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# the most bytes of a request's line and headers (h11's incomplete-event limit; a longer head
# gets 400): ours are under 1 KiB
MAX_HEAD_BYTES = 16 * 1024


def _h11_with_deadline(request_timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline on receiving each request.

    uvicorn closes a connection that idles between two requests (`timeout_keep_alive`), but
    not one that connects and sends nothing, or half a request: each would hold its socket
    (and, mid-body, its handler) for ever. Here the clock starts when a connection opens, or
    when the first bytes of a later request arrive, and stops once the request is in whole;
    at `request_timeout_s` the connection is closed (a handler waiting for the body sees the
    client leave).
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            self._arm()  # a request begins (after a keep-alive wait) or goes on
            super().data_received(data)
            if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
                self._disarm()  # the request is in whole (or the connection is ending)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(request_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                log.warning("closing the connection from %s: no whole request within %g s "
                            "(retrieval.http.request_timeout_s)",
                            ":".join(map(str, self.client or ("?",))), request_timeout_s)
                self.transport.close()

    return Protocol


def server_config(app, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "info",
                  keep_alive_s: float = 5.0, request_timeout_s: float = 30.0) -> uvicorn.Config:
    """uvicorn's settings for `app`: the h11 protocol (whatever else is installed, so the
    limits below always apply) with a deadline per request (`_h11_with_deadline`), a head of
    at most MAX_HEAD_BYTES, and idle connections closed after `keep_alive_s`."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=_h11_with_deadline(request_timeout_s),
                          h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          timeout_keep_alive=keep_alive_s)  # type: ignore[arg-type]


class _Server(uvicorn.Server):
    """uvicorn's server, calling `on_ready(port)` once it listens (port 0: the one it got).
    With `hold_on_sigterm` it keeps serving through SIGTERM (stopped by SIGINT)."""

    def __init__(self, config: uvicorn.Config, on_ready, hold_on_sigterm: bool = False) -> None:
        super().__init__(config)
        self._on_ready = on_ready
        self._hold = hold_on_sigterm

    def handle_exit(self, sig, frame) -> None:
        if self._hold and sig == signal.SIGTERM:
            log.info("SIGTERM: still serving (the job that started this server stops it)")
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self._on_ready is not None:
            self._on_ready(self.servers[0].sockets[0].getsockname()[1])


def serve(
    retriever: Retriever,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    default_topk: int = 3,
    max_batch: int = 256,
    max_wait_ms: float = 5.0,
    log_level: str = "info",
    ready_file: str | None = None,
    hold_on_sigterm: bool = False,
    limits: dict | None = None,
    keep_alive_s: float = 5.0,
    request_timeout_s: float = 30.0,
) -> None:
    """Serve `retriever` over HTTP until SIGINT/SIGTERM, then return after a graceful shutdown.

    Binds 127.0.0.1 unless `host` says otherwise (e.g. "0.0.0.0" to serve other nodes); port 0
    takes a free port. Once it listens, `ready_file` (if given) is written atomically with
    {"host", "port", "url", "pid"}: what a job that started the server waits for and reads.
    `limits`: build_app's max_request_queries, max_topk, max_body_bytes, max_query_chars.
    `keep_alive_s`, `request_timeout_s`: `server_config`'s.
    `hold_on_sigterm`: serve through SIGTERM and stop on SIGINT only. A job's own server
    (`sidecar`) needs it: SLURM's time-limit SIGTERM reaches every process of the job, and the
    trainer still searches until its next safe point.
    """
    import os
    import socket

    from a2tgpo.io import atomic_write_json

    app = build_app(
        retriever, default_topk=default_topk, max_batch=max_batch, max_wait_ms=max_wait_ms,
        **(limits or {}),
    )
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("retrieval server binds %s: reachable from other machines, no auth", host)

    def ready(bound: int) -> None:
        # a wildcard bind is reached through this node's name (from here and other nodes)
        reach = socket.gethostname() if host in ("0.0.0.0", "::") else host
        url = f"http://{reach}:{bound}/retrieve"
        log.info("retrieval server ready at %s", url)
        if ready_file:
            atomic_write_json(ready_file, {"host": host, "port": bound, "url": url,
                                           "pid": os.getpid()})

    config = server_config(app, host=host, port=port, log_level=log_level,
                           keep_alive_s=keep_alive_s, request_timeout_s=request_timeout_s)
    server = _Server(config, ready, hold_on_sigterm)
    received: list[int] = []
    with _absorb_signals(received):
        server.run()
    if received:
        log.info("retrieval server stopped on %s", signal.Signals(received[0]).name)


# --------------------------------------------------------------------------------------------
# client


class RetrieverError(RuntimeError):
    """The retrieval server rejected a request (HTTP 4xx) or answered in an unexpected shape."""


class RetrieverUnavailable(RetrieverError):
    """The retrieval server could not be reached, timed out or kept failing (HTTP 5xx)."""


def _snippet(resp: requests.Response, limit: int = 500) -> str:
    text = resp.text
    return text if len(text) <= limit else text[:limit] + "..."


MAX_BACKOFF_S = 10.0  # the longest sleep between two attempts


class HttpRetriever:
    """`Retriever` over HTTP: ours (`a2tgpo serve-retriever`) or a Search-R1 retrieval server.

    `url` is the full endpoint URL, e.g. "http://127.0.0.1:8000/retrieve". Each request is tried
    up to `retries` times in total, sleeping `backoff_s`, then twice that, and so on (each sleep
    at most MAX_BACKOFF_S), in between; and beyond `retries`, attempts go on while the next one
    starts within `retry_budget_s` of the first (a server restarting).

    A query longer than `max_query_chars` (what our server takes) is cut to that length
    before it is sent: one overlong query the policy wrote must not fail its whole batch with
    a 422. `cut_queries` counts them; a warning says so at the 1st, 10th, 100th, ... cut.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        max_batch_queries: int = 512,
        retry_budget_s: float = 0.0,
        max_query_chars: int = 4096,
    ) -> None:
        if timeout_s <= 0 or retries < 1 or backoff_s < 0 or max_batch_queries < 1 \
                or retry_budget_s < 0 or max_query_chars < 1:
            raise ValueError(
                "need timeout_s > 0, retries >= 1, backoff_s >= 0, max_batch_queries >= 1, "
                f"retry_budget_s >= 0, max_query_chars >= 1; got {timeout_s}, {retries}, "
                f"{backoff_s}, {max_batch_queries}, {retry_budget_s}, {max_query_chars}"
            )
        self.max_query_chars = max_query_chars
        self.cut_queries = 0
        self.url = url
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.retry_budget_s = retry_budget_s
        self.max_batch_queries = max_batch_queries
        self._session = requests.Session()  # keeps the connection open across calls

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        queries = [self._bounded(q) for q in queries]
        out: list[list[Hit]] = []
        for start in range(0, len(queries), self.max_batch_queries):
            out.extend(self._request(list(queries[start : start + self.max_batch_queries]), topk))
        return out

    def close(self) -> None:
        self._session.close()

    def _bounded(self, query: str) -> str:
        if len(query) <= self.max_query_chars:
            return query
        self.cut_queries += 1
        if math.log10(self.cut_queries).is_integer():  # the 1st, 10th, 100th, ...
            log.warning("retriever %s: a query of %d characters cut to %d "
                        "(retrieval.http.max_query_chars); %d cut so far", self.url,
                        len(query), self.max_query_chars, self.cut_queries)
        return query[: self.max_query_chars]

    def _request(self, queries: list[str], topk: int) -> list[list[Hit]]:
        payload = {"queries": queries, "topk": topk, "return_scores": True}
        last_error = ""
        first = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            if attempt > 1:
                pause = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 2))
                if attempt > self.retries and \
                        time.monotonic() + pause - first > self.retry_budget_s:
                    break
                time.sleep(pause)
            try:
                # (connect, read): a tuple so that neither phase can hang without bound.
                resp = self._session.post(
                    self.url, json=payload, timeout=(self.timeout_s, self.timeout_s)
                )
            except (
                requests.ConnectionError,
                requests.Timeout,
                requests.exceptions.ChunkedEncodingError,
            ) as e:
                last_error = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 500:
                    return self._parse(resp, len(queries))
                last_error = f"HTTP {resp.status_code}: {_snippet(resp)}"
            log.warning(
                "retriever %s: attempt %d (of at least %d, for up to %g s) failed: %s",
                self.url, attempt, self.retries, self.retry_budget_s, last_error,
            )
        raise RetrieverUnavailable(
            f"retriever at {self.url} unavailable after {attempt - 1} attempts in "
            f"{time.monotonic() - first:.1f} s (timeout {self.timeout_s:g} s each, "
            f"retrieval.http.retries {self.retries}, retry_budget_s {self.retry_budget_s:g}); "
            f"last error: {last_error}. Check that "
            f"`a2tgpo serve-retriever` or the Search-R1 retrieval server is running and "
            f"reachable at {self.url}."
        )

    def _parse(self, resp: requests.Response, n_queries: int) -> list[list[Hit]]:
        where = f"retriever at {self.url}"
        if not resp.ok:
            raise RetrieverError(
                f"{where} rejected the request: HTTP {resp.status_code}: {_snippet(resp)}"
            )
        try:
            body = resp.json()
        except ValueError:
            raise RetrieverError(f"{where}: response is not JSON: {_snippet(resp)}") from None
        result = body.get("result") if isinstance(body, dict) else None
        if not isinstance(result, list) or len(result) != n_queries:
            got = f"{len(result)} lists" if isinstance(result, list) else _snippet(resp, 200)
            raise RetrieverError(
                f'{where}: expected {{"result": [...]}} with one list per query '
                f"({n_queries}), got {got}"
            )
        return [self._hits(items, i) for i, items in enumerate(result)]

    def _hits(self, items: Any, i: int) -> list[Hit]:
        if not isinstance(items, list):
            raise RetrieverError(f"retriever at {self.url}: result[{i}] is not a list: {items!r}")
        hits = []
        for j, item in enumerate(items):
            doc = item.get("document") if isinstance(item, dict) else None
            score = item.get("score") if isinstance(item, dict) else None
            contents = doc.get("contents") if isinstance(doc, dict) else None
            if not isinstance(contents, str) or not isinstance(score, (int, float)):
                raise RetrieverError(
                    f"retriever at {self.url}: result[{i}][{j}] is not "
                    f'{{"document": {{"contents": str, ...}}, "score": number}}: {item!r:.300}'
                )
            # Search-R1's BM25 path returns documents without "id" (title/text/contents only).
            hits.append(Hit(id=str(doc.get("id", "")), contents=contents, score=float(score)))
        return hits
