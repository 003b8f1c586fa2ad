"""A read-only Hugging Face Hub for a local folder: what `huggingface_hub` downloads from.

    a2tgpo serve-hub FOLDER [--host 0.0.0.0] [--port 8790]

FOLDER holds repos laid out as on the hub, `models/<org>/<name>/...` and
`datasets/<org>/<name>/...`. Pointing HF_ENDPOINT at the server makes the pipeline's own
download code (backbone and encoder pre-fetch, corpus and index download-and-verify, FlashRAG
data) fetch from it exactly as it fetches from huggingface.co: the rehearsal study
(config/rehearsal.yaml, `a2tgpo rehearse`) runs the paper study's code path this way, and a
site with a mirror of the real repos can serve them the same way.

Each repo is served at one commit: the sha1 of its files' names and sha256s, so it changes
exactly when the files do. What huggingface_hub 2.4 asks, and what it gets:

- `GET /api/{models|datasets}/{repo}/revision/{rev}` (rev `main` or the commit): id, sha,
  siblings;
- `GET /api/{models|datasets}/{repo}/tree/{rev}[/{path}]`: the file list, one page (sizes,
  oids, and the sha256 of every file as `lfs.oid`: every file is served like an LFS file);
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}` and `/datasets/{repo}/resolve/{rev}/{file}`: the
  metadata headers (X-Repo-Commit, ETag and X-Linked-Etag = sha256, X-Linked-Size) and the
  bytes, streamed from disk, honouring `Range: bytes=N-` (resumed downloads).
Anything else is a 404 with the hub's X-Error-Code, so clients fail as they would on the hub.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

log = logging.getLogger(__name__)

KINDS = {"models": "model", "datasets": "dataset"}
_INFO = re.compile(
    r"^/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)$")
_TREE = re.compile(
    r"^/api/(?P<kind>models|datasets)/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?$")
_RESOLVE = re.compile(
    r"^/(?:(?P<kind>datasets)/)?(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class HubFile:
    path: Path
    size: int
    sha256: str
    sha1: str  # git-blob-like oid the tree listing reports


@dataclass(frozen=True)
class HubRepo:
    kind: str  # "models" | "datasets"
    repo_id: str
    commit: str
    files: dict[str, HubFile]


def _hash(path: Path) -> tuple[str, str]:
    sha256, sha1 = hashlib.sha256(), hashlib.sha1()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            sha1.update(chunk)
    return sha256.hexdigest(), sha1.hexdigest()


def scan(root: str | Path) -> dict[tuple[str, str], HubRepo]:
    """Every repo under `root` ((kind, repo_id) -> HubRepo); ValueError if there is none."""
    root = Path(root)
    repos = {}
    for kind in KINDS:
        for folder in sorted(root.glob(f"{kind}/*/*")):
            if not folder.is_dir():
                continue
            files = {}
            for p in sorted(folder.rglob("*")):
                if p.is_file() and not any(part.startswith(".") for part in
                                           p.relative_to(folder).parts):
                    sha256, sha1 = _hash(p)
                    files[p.relative_to(folder).as_posix()] = HubFile(p, p.stat().st_size,
                                                                       sha256, sha1)
            listing = "".join(f"{name}\0{f.sha256}\n" for name, f in files.items())
            commit = hashlib.sha1(listing.encode()).hexdigest()
            repo_id = f"{folder.parent.name}/{folder.name}"
            repos[(kind, repo_id)] = HubRepo(kind, repo_id, commit, files)
    if not repos:
        raise ValueError(f"{root}: no repos (expected models/<org>/<name>/ or "
                         "datasets/<org>/<name>/ folders)")
    return repos


class LocalHub:
    """The server (module docstring). `start()` serves in a thread; `url` is its endpoint."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0,
                 public_host: str | None = None) -> None:
        self.root = Path(root)
        self.repos = scan(self.root)
        self.request_count = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def log_message(self, fmt, *args) -> None:
                log.debug("%s %s", self.address_string(), fmt % args)

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{public_host or host}:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True)

    def start(self) -> LocalHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests ------------------------------------------------------------------------

    def _repo(self, kind: str, repo_id: str, rev: str) -> HubRepo | str:
        repo = self.repos.get((kind, repo_id))
        if repo is None:
            return "RepoNotFound"
        if rev not in ("main", repo.commit):
            return "RevisionNotFound"
        return repo

    def _handle(self, req: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(urlparse(req.path).path)
        self.request_count += 1
        if m := _INFO.match(path):
            repo = self._repo(m["kind"], m["repo"], m["rev"])
            if isinstance(repo, str):
                return self._error(req, repo)
            return self._json(req, {"id": repo.repo_id, "sha": repo.commit, "private": False,
                                    "siblings": [{"rfilename": f} for f in repo.files]})
        if m := _TREE.match(path):
            repo = self._repo(m["kind"], m["repo"], m["rev"])
            if isinstance(repo, str):
                return self._error(req, repo)
            sub = (m["sub"] or "").strip("/")
            entries = [{"type": "file", "path": name, "size": f.size, "oid": f.sha1,
                        "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}}
                       for name, f in repo.files.items()
                       if not sub or name.startswith(sub + "/")]
            return self._json(req, entries)
        if m := _RESOLVE.match(path):
            repo = self._repo(m["kind"] or "models", m["repo"], m["rev"])
            if isinstance(repo, str):
                return self._error(req, repo)
            f = repo.files.get(m["file"])
            if f is None:
                return self._error(req, "EntryNotFound", {"X-Repo-Commit": repo.commit})
            return self._file(req, repo, f, body=body)
        return self._error(req, "RepoNotFound")

    def _file(self, req, repo: HubRepo, f: HubFile, *, body: bool) -> None:
        start, status = 0, 200
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{f.sha256}"',
                   "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size),
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if m := re.fullmatch(r"bytes=(\d+)-", req.headers.get("Range") or ""):
            start, status = min(int(m[1]), f.size), 206
            headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(f.size - start))
        req.end_headers()
        if not body:
            return
        with open(f.path, "rb") as fh:
            fh.seek(start)
            while chunk := fh.read(_CHUNK):
                req.wfile.write(chunk)

    def _json(self, req, obj) -> None:
        payload = json.dumps(obj).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(payload)

    @staticmethod
    def _error(req, code: str, headers: dict[str, str] | None = None) -> None:
        payload = json.dumps({"error": code}).encode()
        req.send_response(404)
        req.send_header("X-Error-Code", code)
        for k, v in (headers or {}).items():
            req.send_header(k, v)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(payload)


def summary(hub: LocalHub) -> str:
    lines = [f"serving {len(hub.repos)} repos from {hub.root} at {hub.url}"]
    for (kind, repo_id), repo in sorted(hub.repos.items()):
        size = sum(f.size for f in repo.files.values())
        lines.append(f"  {KINDS[kind]:7s} {repo_id} @ {repo.commit[:12]}: "
                     f"{len(repo.files)} files, {size / 1e6:.1f} MB")
    return "\n".join(lines)
