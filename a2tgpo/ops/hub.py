"""A read-only Hugging Face Hub for a local folder: what `huggingface_hub` downloads from.

    a2tgpo serve-hub FOLDER [--host 0.0.0.0] [--port 8790] [--timeout 30] [--follow-symlinks]

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
  bytes, streamed from disk, honouring a single byte range (`Range: bytes=N-`, as a resumed
  download asks; `N-M` and `-N` too) with 206. A range that starts at or past the end (or
  `-0`) gets 416 with `Content-Range: bytes */size`; a malformed one (`bytes=5-2`, `bytes=x`)
  gets 400. As RFC 9110 §14.2 allows, a Range of another unit, or of several ranges, is
  ignored: the whole file, 200.
Anything else is a 404 with the hub's X-Error-Code, so clients fail as they would on the hub.

What it refuses to serve: hidden files (a path part starting with "."), and files whose real
path, symlinks resolved, lies outside FOLDER (a link to /etc/passwd placed in a repo), unless
`follow_symlinks` (`--follow-symlinks`) allows them; links that stay inside FOLDER are served.
Each connection must send its whole request head (request line and headers) within
`timeout_s` of connecting, and each read or write of it may take at most `timeout_s`; else it
is closed, so silent or half-sent connections do not hold their threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import socket
import threading
import time
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


def _inside(path: Path, root: Path) -> bool:
    """Whether `path`, every symlink resolved, lies in `root` (itself resolved)."""
    return path.resolve().is_relative_to(root)


def scan(root: str | Path, *, follow_symlinks: bool = False) -> dict[tuple[str, str], HubRepo]:
    """Every repo under `root` ((kind, repo_id) -> HubRepo); ValueError if there is none.
    Files whose real path leaves `root` are left out, with a warning, unless
    `follow_symlinks`."""
    root = Path(root)
    real_root = root.resolve()
    repos = {}
    for kind in KINDS:
        for folder in sorted(root.glob(f"{kind}/*/*")):
            if not folder.is_dir():
                continue
            files = {}
            for p in sorted(folder.rglob("*")):
                if p.is_file() and not any(part.startswith(".") for part in
                                           p.relative_to(folder).parts):
                    if not follow_symlinks and not _inside(p, real_root):
                        log.warning("%s: not served: it leads to %s, outside %s (serve-hub "
                                    "--follow-symlinks serves such links)", p, p.resolve(),
                                    root)
                        continue
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


class RangeError(ValueError):
    """A Range header the hub answers with `status` (400 malformed, 416 unsatisfiable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _position(digits: str) -> int:
    # int() refuses more than 4300 digits; anything past 2^63 is past the end of any file
    return int(digits) if len(digits) < 19 else 1 << 63


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The byte range (first, last, both included) that a Range header asks of a file of
    `size` bytes (RFC 9110 §14.1.2); None: serve the whole file (no header, another unit, or
    several ranges, which a server may ignore). RangeError 416 for a range that starts at or
    past the end, or an empty suffix; 400 for a malformed one."""
    if header is None:
        return None
    unit, eq, spec = header.partition("=")
    if not eq:
        raise RangeError(400, f"malformed Range {header[:80]!r}: expected bytes=first-last")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    m = re.fullmatch(r"\s*(\d*)-(\d*)\s*", spec)
    if m is None or not (m[1] or m[2]):
        raise RangeError(400, f"malformed Range {header[:80]!r}: expected bytes=first-last, "
                         "bytes=first- or bytes=-suffix")
    if m[1]:
        first = _position(m[1])
        last = _position(m[2]) if m[2] else size - 1
        if m[2] and last < first:
            raise RangeError(400, f"malformed Range {header[:80]!r}: last before first")
        if first >= size:
            raise RangeError(416, f"range starts at {m[1][:20]}, at or past the end of the "
                             f"{size} bytes")
        return first, min(last, size - 1)
    suffix = _position(m[2])
    if suffix == 0 or size == 0:
        raise RangeError(416, f"a suffix of {m[2][:20]} bytes of a {size}-byte file is empty")
    return max(0, size - suffix), size - 1


class _HeadReader:
    """A connection's reader for the request head (request line and headers) with one
    deadline for all of it: a per-read timeout alone lets a client that sends a byte now and
    then hold its thread for ever. Only what BaseHTTPRequestHandler asks of a GET or HEAD
    (`readline`, `close`)."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self._sock, self._seconds = sock, seconds
        self._end = time.monotonic() + seconds
        self._buf = b""

    def readline(self, limit: int = -1) -> bytes:
        while True:
            end = self._buf.find(b"\n") + 1
            if end == 0 and 0 <= limit <= len(self._buf):
                end = limit
            if end:
                line, self._buf = self._buf[:end], self._buf[end:]
                return line
            left = self._end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no whole request head within {self._seconds:g} s")
            self._sock.settimeout(left)
            chunk = self._sock.recv(65536)
            if not chunk:  # the client closed: what there is
                line, self._buf = self._buf, b""
                return line
            self._buf += chunk

    def close(self) -> None:
        pass


class LocalHub:
    """The server (module docstring). `start()` serves in a thread; `url` is its endpoint."""

    def __init__(self, root: str | Path, host: str = "127.0.0.1", port: int = 0,
                 public_host: str | None = None, *, follow_symlinks: bool = False,
                 timeout_s: float = 30.0) -> None:
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout_s}")
        self.root = Path(root)
        self.follow_symlinks = follow_symlinks
        self.repos = scan(self.root, follow_symlinks=follow_symlinks)
        self.request_count = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            timeout = timeout_s  # each read and write; the stdlib closes the connection after

            def setup(self) -> None:
                super().setup()
                self.rfile.close()  # GET and HEAD carry no body: only the head is read
                self.rfile = _HeadReader(self.connection, timeout_s)

            def do_HEAD(self) -> None:
                self.connection.settimeout(timeout_s)  # the head is in: writes from here
                hub._handle(self, body=False)

            def do_GET(self) -> None:
                self.connection.settimeout(timeout_s)
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
        # checked again when served: the file may have become a link since the scan, and
        # the resolved path is what is opened
        real = f.path.resolve()
        if not self.follow_symlinks and not real.is_relative_to(self.root.resolve()):
            log.warning("%s: not served: it now leads to %s, outside %s", f.path, real,
                        self.root)
            return self._error(req, "EntryNotFound", {"X-Repo-Commit": repo.commit})
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{f.sha256}"',
                   "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size),
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        try:
            asked = byte_range(req.headers.get("Range"), f.size)
        except RangeError as e:
            if e.status == 416:
                headers["Content-Range"] = f"bytes */{f.size}"
            return self._error(req, "RangeNotSatisfiable" if e.status == 416 else "BadRequest",
                               headers, status=e.status, detail=str(e))
        first, last, status = 0, f.size - 1, 200
        if asked is not None:
            (first, last), status = asked, 206
            headers["Content-Range"] = f"bytes {first}-{last}/{f.size}"
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(last + 1 - first))
        req.end_headers()
        if not body:
            return
        with open(real, "rb") as fh:
            fh.seek(first)
            left = last + 1 - first
            while left > 0 and (chunk := fh.read(min(_CHUNK, left))):
                req.wfile.write(chunk)
                left -= len(chunk)

    def _json(self, req, obj) -> None:
        payload = json.dumps(obj).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(payload)

    @staticmethod
    def _error(req, code: str, headers: dict[str, str] | None = None, *, status: int = 404,
               detail: str | None = None) -> None:
        payload = json.dumps({"error": code, **({"detail": detail} if detail else {})}).encode()
        req.send_response(status)
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
