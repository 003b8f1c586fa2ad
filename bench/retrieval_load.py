"""Retrieval server under a mixed load on loopback: small requests next to large and bad ones.

The real server (`a2tgpo.retrieval.http.build_app` under uvicorn on 127.0.0.1, port 0) runs in
a child process, over a retriever whose search sleeps `--base-ms` + `--per-query-ms` per query
(the shape of a batched encode + faiss search on a GPU; sleeping leaves the CPUs to the HTTP
work). The child serves two apps: one that searches a request larger than `--max-batch` in
pieces taking turns with the other requests (the default), and one that searches it in one call.

Three phases, each an open-loop schedule over `--duration` seconds (every request starts at its
own time, whatever the others' latency), from a pool of client threads:
  small only      `--small` innocent requests of 1-4 queries
  mixed, split    the same + `--large` innocent requests of `--large-queries` (> max_batch)
                  + `--bad` bad ones (a lone surrogate as raw JSON, topk 10**9, too many
                  queries, a query the retriever fails on), against the splitting app
  mixed, unsplit  the same schedule against the other app

Prints the innocent requests and their failures (an error status or wrong hits), the bad
requests' status codes, p50/p99 latency of the small requests per phase and the ratios. Exits 1
if any innocent request failed or a bad one got another status than expected.

Usage: ./run python bench/retrieval_load.py [--quick] [--small 120] [--large 3] [--duration 1.5]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import requests

POISON = "poison-query"  # the child's retriever raises on this query
BAD_KINDS = {  # kind -> the status the server must answer
    "lone surrogate": 422,
    "topk 10**9": 422,
    "too many queries": 413,
    "retriever fails": 500,
}


# --------------------------------------------------------------------------------------------
# server (child process)


class SleepyRetriever:
    """Hits derived from the query text after sleeping base_s + per_query_s per query."""

    def __init__(self, base_s: float, per_query_s: float) -> None:
        self.base_s, self.per_query_s = base_s, per_query_s

    def search(self, queries: list[str], topk: int):
        from a2tgpo.retrieval.base import Hit

        time.sleep(self.base_s + self.per_query_s * len(queries))
        if POISON in queries:
            raise RuntimeError("the retriever cannot search this query")
        return [[Hit(f"{q}#{r}", q, 1.0 / (r + 1)) for r in range(topk)] for q in queries]

    def close(self) -> None:
        pass


def serve_child(args: argparse.Namespace) -> None:
    """Serve the split and unsplit apps; print their ports as one JSON line; stop at stdin EOF."""
    import socket

    import uvicorn

    from a2tgpo.retrieval.http import build_app

    # the bad requests' failures are expected, and their statuses checked by the client
    logging.getLogger("a2tgpo.retrieval.http").setLevel(logging.CRITICAL)
    servers, threads, ports = [], [], {}
    for name, split in (("split", True), ("unsplit", False)):
        app = build_app(
            SleepyRetriever(args.base_ms / 1e3, args.per_query_ms / 1e3), default_topk=3,
            max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
            max_request_queries=args.max_request_queries, split_requests=split)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        ports[name] = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append(server)
        threads.append(thread)
    while not all(s.started for s in servers):
        time.sleep(0.01)
    print(json.dumps(ports), flush=True)
    sys.stdin.read()
    for s in servers:
        s.should_exit = True
    for t in threads:
        t.join(10)


# --------------------------------------------------------------------------------------------
# load (parent process)


@dataclass
class Req:
    at: float       # seconds after the phase starts
    kind: str       # "small", "large" or one of BAD_KINDS
    body: str       # the JSON body, sent as is (so a lone surrogate reaches the server)
    queries: list[str]
    topk: int


def schedule(args: argparse.Namespace, mixed: bool, seed: int = 0) -> list[Req]:
    rng = random.Random(seed)
    d = args.duration
    out = []
    for i in range(args.small):
        qs = [f"s{i}.{j}" for j in range(rng.randint(1, 4))]
        out.append(Req(d * i / args.small, "small", json.dumps(
            {"queries": qs, "topk": 3, "return_scores": True}), qs, 3))
    if not mixed:
        return out
    for k in range(args.large):
        qs = [f"L{k}.{j}" for j in range(args.large_queries)]
        out.append(Req(d * (k + 0.25) / args.large, "large", json.dumps(
            {"queries": qs, "topk": 3, "return_scores": True}), qs, 3))
    kinds = list(BAD_KINDS)
    for b in range(args.bad):
        kind = kinds[b % len(kinds)]
        body = {
            # the JSON escape \\ud800: valid JSON, but not text any tokenizer takes
            "lone surrogate": '{"queries": ["fine", "bad \\ud800"], "topk": 3}',
            "topk 10**9": json.dumps({"queries": ["q"], "topk": 10**9}),
            "too many queries": json.dumps(
                {"queries": ["q"] * (args.max_request_queries + 1), "topk": 3}),
            "retriever fails": json.dumps({"queries": ["q", POISON], "topk": 3}),
        }[kind]
        out.append(Req(d * (b + 0.5) / args.bad, kind, body, [], 0))
    return sorted(out, key=lambda r: r.at)


def run_phase(url: str, reqs: list[Req], threads: int) -> list[tuple[Req, int, float, bool]]:
    """Send `reqs` on schedule; (request, status, latency s, hits right) for each."""
    local = threading.local()
    start = time.perf_counter() + 0.05

    def one(r: Req) -> tuple[Req, int, float, bool]:
        if not hasattr(local, "session"):
            local.session = requests.Session()  # keep-alive, as the real client
        time.sleep(max(0.0, start + r.at - time.perf_counter()))
        t = time.perf_counter()
        try:
            resp = local.session.post(url, data=r.body.encode(), timeout=60,
                                      headers={"Content-Type": "application/json"})
        except requests.RequestException:
            return r, 0, time.perf_counter() - t, False
        latency = time.perf_counter() - t
        right = False
        if resp.status_code == 200 and r.queries:
            result = resp.json()["result"]
            right = len(result) == len(r.queries) and all(
                [item["document"]["id"] for item in hits] == [f"{q}#{k}" for k in range(r.topk)]
                for q, hits in zip(r.queries, result, strict=False))
        return r, resp.status_code, latency, right

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, reqs))


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1e3 if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny load, for the tests")
    ap.add_argument("--small", type=int, default=120, help="small requests per phase")
    ap.add_argument("--large", type=int, default=3, help="large requests per mixed phase")
    ap.add_argument("--large-queries", type=int, default=3000)
    ap.add_argument("--bad", type=int, default=8, help="bad requests per mixed phase")
    ap.add_argument("--duration", type=float, default=1.5, help="seconds per phase")
    ap.add_argument("--threads", type=int, default=64, help="client threads")
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--base-ms", type=float, default=2.0, help="cost of one search call")
    ap.add_argument("--per-query-ms", type=float, default=0.1, help="cost of each query in it")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    ap.add_argument("--max-request-queries", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.small, args.large, args.large_queries, args.bad, args.duration = 40, 1, 600, 4, 0.3
    if args.max_request_queries is None:
        args.max_request_queries = max(4096, args.large_queries)
    if args.serve:
        serve_child(args)
        return 0
    if args.large and args.large_queries <= args.max_batch:
        ap.error(f"--large-queries {args.large_queries} must exceed --max-batch {args.max_batch}")

    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--max-batch", str(args.max_batch),
         "--max-wait-ms", str(args.max_wait_ms), "--base-ms", str(args.base_ms),
         "--per-query-ms", str(args.per_query_ms),
         "--max-request-queries", str(args.max_request_queries)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline()
        if not line:
            print("the server process exited before listening", file=sys.stderr)
            return 1
        ports = json.loads(line)
        url = {k: f"http://127.0.0.1:{p}/retrieve" for k, p in ports.items()}
        for u in url.values():  # warm-up: connections, first-call imports
            run_phase(u, schedule(args, mixed=False)[:8], 8)
        phases = {
            "small only": run_phase(url["split"], schedule(args, mixed=False), args.threads),
            "mixed, split": run_phase(url["split"], schedule(args, mixed=True), args.threads),
            "mixed, unsplit": run_phase(url["unsplit"], schedule(args, mixed=True), args.threads),
        }
    finally:
        child.stdin.close()
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            child.kill()

    print(f"retrieval server under load: max_batch {args.max_batch}, search {args.base_ms:g} ms "
          f"+ {args.per_query_ms:g} ms/query; per phase over {args.duration:g} s: {args.small} "
          f"small requests (1-4 queries), mixed: + {args.large} large ({args.large_queries} "
          f"queries) + {args.bad} bad")
    print(f"{'phase':<16}{'small p50 ms':>14}{'small p99 ms':>14}{'large p50 ms':>14}")
    p50, p99 = {}, {}
    innocent, failed, bad = 0, 0, Counter()
    for name, results in phases.items():
        small = [lat for r, _, lat, _ in results if r.kind == "small"]
        large = [lat for r, _, lat, _ in results if r.kind == "large"]
        p50[name], p99[name] = pct(small, 50), pct(small, 99)
        large_p50 = f"{pct(large, 50):.1f}" if large else "-"
        print(f"{name:<16}{p50[name]:>14.1f}{p99[name]:>14.1f}{large_p50:>14}")
        for r, status, _, right in results:
            if r.kind in ("small", "large"):
                innocent += 1
                failed += not (status == 200 and right)
            else:
                bad[(r.kind, status)] += 1
    wrong = sum(n for (kind, status), n in bad.items() if status != BAD_KINDS[kind])
    print(f"innocent requests  {innocent}")
    print(f"innocent failures  {failed}")
    print(f"bad requests  {sum(bad.values())}: " + ", ".join(
        f"{kind} -> {status} x{n}" for (kind, status), n in sorted(bad.items())))
    print(f"bad requests with an unexpected status  {wrong}")
    base = p99["small only"]
    print(f"small p99, mixed / small only (split)  {p99['mixed, split'] / base:.2f}")
    print(f"small p99, mixed / small only (unsplit)  {p99['mixed, unsplit'] / base:.2f}")
    for q, p in (("p50", p50), ("p99", p99)):
        print(f"small {q} with large ones present: unsplit / split  "
              f"{p['mixed, unsplit'] / p['mixed, split']:.2f}")
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
