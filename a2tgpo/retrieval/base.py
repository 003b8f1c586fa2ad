"""The retriever interface every search tool call goes through.

A retriever maps a batch of query strings to, per query, the top-k passages with scores. The
in-process retrievers (dense faiss, BM25) and the HTTP client (Search-R1's `/retrieve` API)
implement the same `search`, so the agent loop never knows which one it talks to.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass
from typing import Literal, Protocol

from a2tgpo.config import InvalidKey, option


@dataclass(frozen=True)
class Hit:
    """One retrieved passage: the corpus row `{"id", "contents"}` plus its score."""

    id: str
    contents: str
    score: float

    @property
    def title(self) -> str:
        """wiki-18 contents are '"Title"\\ntext'; the title without its quotes."""
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1] if len(parts) > 1 else ""


class Retriever(Protocol):
    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Top-`topk` hits per query, best first; one list per query, in query order."""
        ...

    def close(self) -> None:
        """Release resources (threads, sessions, GPU memory)."""
        ...


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_error(host: str) -> str | None:
    """Why `host` is neither an IP address nor a host name a server can bind (None: it is)."""
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        return None
    return f"{host!r} is neither an IP address nor a host name"


@dataclass(frozen=True)
class HttpConfig:
    """The retrieval server (`a2tgpo serve-retriever`) and the client that talks to it."""

    url: str = option(
        "http://127.0.0.1:8000/retrieve",
        "Client: full URL of the /retrieve endpoint (ours or a Search-R1 retrieval server).",
    )
    timeout_s: float = option(
        30.0, "Client: connect and read timeout of one HTTP attempt, in seconds.", gt=0
    )
    retries: int = option(
        3,
        "Client: attempts in total per request (>= 1) before giving up; connection errors, "
        "timeouts and HTTP 5xx are retried, HTTP 4xx and malformed responses are not.", ge=1
    )
    backoff_s: float = option(
        0.5, "Client: sleep before the 2nd attempt, in seconds; doubled before each later one "
        "(at most 10 s).", ge=0
    )
    retry_budget_s: float = option(
        60.0, "Client: after `retries` attempts, go on retrying while the next attempt starts "
        "within this many seconds of the first: long enough for a server to restart (loading "
        "a small index takes 8-15 s). 0 = `retries` attempts only.", ge=0)
    max_batch_queries: int = option(
        512, "Client: most queries sent in one request; longer query lists go in several.", ge=1
    )
    serve: Literal["external", "job"] = option(
        "external",
        "external = use the server at `url` (started by you); job = every training and "
        "evaluation job starts its own server on its node on a free port and stops it at the "
        "end (`a2tgpo with-retriever`), and its client ignores `url`.",
    )
    start_timeout_s: float = option(
        1800.0, "serve job: how long a job waits for its server to load the index and listen.",
        gt=0)
    host: str = option(
        "127.0.0.1",
        "Server: address to bind. 0.0.0.0 makes it reachable from other machines, without any "
        "authentication.",
    )
    port: int = option(8000, "Server: TCP port to listen on (Search-R1's default is 8000).",
                       ge=0, le=65535)
    max_batch: int = option(
        256,
        "Server: most queries per retriever call; concurrent requests are merged up to this. "
        "A request larger than this is searched in pieces, taking turns with the others.", ge=1
    )
    max_wait_ms: float = option(
        5.0,
        "Server: after the first request of a batch arrives, how long to wait for more before "
        "searching, in milliseconds (latency traded for larger batches).", ge=0
    )
    max_request_queries: int = option(
        4096, "Server: most queries one request may carry (HTTP 413 beyond; the client sends "
        "max_batch_queries per request).", ge=1)
    max_topk: int = option(100, "Server: largest topk a request may ask (HTTP 422 beyond).", ge=1)
    max_body_bytes: int = option(
        16 * 2**20, "Server: largest request body in bytes (HTTP 413 beyond, before parsing: "
        "by Content-Length, and for a chunked body by the bytes as they arrive).", ge=1)
    max_query_chars: int = option(
        4096, "Server: longest query in characters (HTTP 422 beyond; a long query costs the "
        "encoder or BM25 time for the whole batch). Client: longer queries are cut to this "
        "before sending, with a warning and a count. 4096 is twice what the encoders read "
        "(e5 and MiniLM stop at 512 tokens, about 2,000 characters of English), and a policy's "
        "query is at most one turn (rollout.max_turn_tokens, 500 by default).", ge=1)
    keep_alive_s: float = option(
        5.0, "Server: an idle connection between two requests is closed after this many "
        "seconds (uvicorn's timeout_keep_alive; the client reconnects).", gt=0)
    request_timeout_s: float = option(
        30.0, "Server: a client must send a whole request (headers and body) within this "
        "many seconds of starting it (of connecting, for a connection's first); else the "
        "connection is closed, so silent or half-sent connections do not pile up.", gt=0)

    def __post_init__(self) -> None:
        if error := host_error(self.host):
            raise InvalidKey("host", error)
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected http:// or https://, got {self.url!r}")
        if self.retry_budget_s < 0:
            raise ValueError(f"retry_budget_s must be >= 0, got {self.retry_budget_s}")
        for name in ("timeout_s", "keep_alive_s", "request_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:  # a timer of inf (or nan) never fires
                raise ValueError(f"{name}: must be > 0 and finite, got {getattr(self, name)}")
        for name in ("retries", "max_batch_queries", "max_batch", "max_request_queries",
                     "max_topk", "max_body_bytes", "max_query_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("backoff_s", "max_wait_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in 0..65535, got {self.port}")
