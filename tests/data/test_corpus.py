"""`download_corpus` against a local stand-in for the Hugging Face Hub (no network).

`FakeHub` answers the requests huggingface_hub 2.4.0 makes to download a dataset file:

- `HEAD {endpoint}/datasets/{repo}/resolve/{revision}/{file}` (metadata) and the `GET` of the
  same URL: a 302 whose headers carry the metadata (`X-Repo-Commit`, `X-Linked-Etag` = sha256,
  `X-Linked-Size`), redirecting, as the real hub does for LFS/Xet files, to a "CDN" on another
  host (`localhost` instead of `127.0.0.1`). huggingface_hub does not follow a HEAD redirect to
  another host, so it reads the metadata from the 302 itself.
- `GET http://localhost:{port}/cdn/{repo}/{file}`: the bytes, honouring `Range: bytes=N-` (206).

No `X-Xet-Hash` header is ever sent, so huggingface_hub uses plain HTTP, not Xet.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest
from huggingface_hub import constants

from a2tgpo.config import ConfigError, load_config
from a2tgpo.data.corpus import (
    MANIFEST,
    STAGING,
    CorpusConfig,
    CorpusError,
    PrebuiltIndexConfig,
    download_corpus,
    main,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CORPUS_REPO = "PeterJinGo/wiki-18-corpus"
INDEX_REPO = "PeterJinGo/wiki-18-e5-index"
RESOLVE = re.compile(r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
CDN = re.compile(r"^/cdn/(?P<repo>[^/]+/[^/]+)/(?P<file>.+)$")


class FakeHub:
    """A threaded HTTP server emulating the hub endpoints above, with injectable faults."""

    def __init__(self) -> None:
        self.files: dict[tuple[str, str], bytes] = {}
        self.served: dict[tuple[str, str], bytes] = {}  # bytes sent instead of the advertised ones
        self.truncate_once: dict[tuple[str, str], int] = {}  # drop the next GET after N bytes
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self) -> None:
                hub._handle(self, body=False)

            def do_GET(self) -> None:
                hub._handle(self, body=True)

            def log_message(self, *args) -> None:  # keep pytest output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def _handle(self, req: BaseHTTPRequestHandler, *, body: bool) -> None:
        path = unquote(req.path)
        self.requests.append((req.command, path, req.headers.get("Range")))
        if m := RESOLVE.match(path):
            self._resolve(req, m["repo"], m["rev"], m["file"])
        elif m := CDN.match(path):
            self._cdn(req, (m["repo"], m["file"]), body=body)
        else:
            self._send(req, 404, {"X-Error-Code": "RepoNotFound"})

    def _resolve(self, req: BaseHTTPRequestHandler, repo: str, rev: str, file: str) -> None:
        if rev not in ("main", COMMIT):
            self._send(req, 404, {"X-Error-Code": "RevisionNotFound"})
            return
        data = self.files.get((repo, file))
        if data is None:
            self._send(req, 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT})
            return
        self._send(
            req,
            302,
            {
                "Location": f"http://localhost:{self.port}/cdn/{repo}/{file}",
                "X-Repo-Commit": COMMIT,
                # The git oid of the LFS pointer; huggingface_hub prefers X-Linked-Etag.
                "ETag": '"' + hashlib.sha1(data).hexdigest() + '"',
                "X-Linked-Etag": '"' + hashlib.sha256(data).hexdigest() + '"',
                "X-Linked-Size": str(len(data)),
            },
        )

    def _cdn(self, req: BaseHTTPRequestHandler, key: tuple[str, str], *, body: bool) -> None:
        if key not in self.files:
            self._send(req, 404, {})
            return
        data = self.served.get(key, self.files[key])
        start = 0
        status = 200
        headers = {"Accept-Ranges": "bytes", "ETag": '"' + hashlib.sha256(data).hexdigest() + '"'}
        if m := re.fullmatch(r"bytes=(\d+)-", req.headers.get("Range") or ""):
            start, status = int(m[1]), 206
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        payload = data[start:]
        if body and key in self.truncate_once:
            # Promise the whole body, send part of it, hang up: a connection lost mid-download.
            payload = payload[: self.truncate_once.pop(key)]
            req.close_connection = True
            self._send(req, status, headers, payload, length=len(data) - start)
            return
        self._send(req, status, headers, payload if body else b"", length=len(payload))

    @staticmethod
    def _send(req, status, headers, payload=b"", length=None) -> None:
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(len(payload) if length is None else length))
        req.end_headers()
        req.wfile.write(payload)

    def count(self, *, method: str | None = None, prefix: str = "/") -> int:
        return sum(
            1
            for m, p, _ in self.requests
            if (method is None or m == method) and p.startswith(prefix)
        )


@pytest.fixture
def hub(hf_home):
    fake = FakeHub()
    fake.thread.start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()
    fake.thread.join()


def make_corpus(n: int, compresslevel: int = 9) -> bytes:
    """`n` wiki-18-style JSONL passages (about 280 bytes a line), gzipped."""
    rows = [
        {"id": str(i), "contents": f'"Title {i}"\npassage {i} ' + "text " * 44} for i in range(n)
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    return gzip.compress(text.encode(), compresslevel=compresslevel, mtime=0)


def corpus_cfg(hub: FakeHub, **kw) -> CorpusConfig:
    return CorpusConfig(endpoint=hub.endpoint, expected_lines=kw.pop("expected_lines", 5), **kw)


def leftovers(out: Path, name: str) -> list[Path]:
    """Copies of `name` anywhere under `out`, partial downloads and temp files included."""
    return [
        p
        for p in out.rglob("*")
        if p.is_file() and (p.name == name or p.suffix in (".incomplete", ".tmp"))
    ]


def test_downloads_verifies_and_records(hub, tmp_path):
    data = make_corpus(5)
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = data
    out = tmp_path / "out"
    summary = download_corpus(corpus_cfg(hub), out)

    assert (out / "wiki-18.jsonl.gz").read_bytes() == data
    entry = summary["corpus"]
    assert entry["status"] == "fetched"
    assert (entry["lines"], entry["bytes"], entry["commit"]) == (5, len(data), COMMIT)
    assert entry["sha256"] == hashlib.sha256(data).hexdigest() == entry["etag"]
    assert summary["index"] is None
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["files"]["wiki-18.jsonl.gz"]["sha256"] == entry["sha256"]
    # The metadata HEAD went to the hub, the bytes came from the "CDN" it redirected to.
    assert hub.count(method="HEAD", prefix="/datasets/") >= 1
    assert hub.count(method="GET", prefix="/cdn/") == 1
    assert not leftovers(out / STAGING, ".incomplete")


def test_second_call_makes_no_request_and_a_missing_file_is_fetched_again(hub, tmp_path):
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = make_corpus(5)
    out = tmp_path / "out"
    download_corpus(corpus_cfg(hub), out)
    before = len(hub.requests)
    again = download_corpus(corpus_cfg(hub), out)
    assert len(hub.requests) == before
    assert again["corpus"]["status"] == "present"

    (out / "wiki-18.jsonl.gz").unlink()
    third = download_corpus(corpus_cfg(hub), out)
    assert third["corpus"]["status"] == "fetched"
    assert hub.count(method="GET", prefix="/cdn/") == 2


def test_config_change_reverifies_without_downloading(hub, tmp_path):
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = make_corpus(5)
    out = tmp_path / "out"
    download_corpus(corpus_cfg(hub, expected_lines=None), out)
    # The file goes back to staging, huggingface_hub sees the same commit and keeps it.
    summary = download_corpus(corpus_cfg(hub, expected_lines=5), out)
    assert summary["corpus"]["status"] == "fetched" and summary["corpus"]["lines"] == 5
    assert hub.count(method="GET", prefix="/cdn/") == 1


def test_wrong_expected_lines_fails_and_leaves_no_file(hub, tmp_path):
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = make_corpus(5)
    out = tmp_path / "out"
    msg = r"wiki-18\.jsonl\.gz: has 5 lines but expected_lines is 7; kept it in .*\.download"
    with pytest.raises(CorpusError, match=msg):
        download_corpus(corpus_cfg(hub, expected_lines=7), out)
    assert not (out / "wiki-18.jsonl.gz").exists()
    assert not (out / MANIFEST).exists()
    # The bytes matched the hub (size, sha256): the fix is the config's and needs no new download.
    summary = download_corpus(corpus_cfg(hub, expected_lines=5), out)
    assert summary["corpus"]["lines"] == 5
    assert hub.count(method="GET", prefix="/cdn/") == 1


def test_expected_bytes_mismatch_names_both_sizes(hub, tmp_path):
    data = make_corpus(5)
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = data
    out = tmp_path / "out"
    msg = rf"wiki-18\.jsonl\.gz: is {len(data):,} bytes but expected_bytes says 12,345"
    with pytest.raises(CorpusError, match=msg):
        download_corpus(corpus_cfg(hub, expected_bytes=12345), out)
    assert not (out / "wiki-18.jsonl.gz").exists()


def test_damaged_local_copy_is_downloaded_afresh(hub, tmp_path):
    data = make_corpus(5)
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = data
    out = tmp_path / "out"
    download_corpus(corpus_cfg(hub), out)
    (out / "wiki-18.jsonl.gz").write_bytes(data[:-10])
    # The manifest no longer matches; huggingface_hub's bookkeeping (same commit) would hand the
    # damaged copy back, so the size check against the hub must catch it.
    summary = download_corpus(corpus_cfg(hub), out)
    assert summary["corpus"]["status"] == "fetched"
    assert (out / "wiki-18.jsonl.gz").read_bytes() == data
    assert hub.count(method="GET", prefix="/cdn/") == 2


def test_short_response_is_detected(hub, tmp_path):
    # The hub advertises the full size but the CDN serves (with a consistent Content-Length) less:
    # huggingface_hub's own size check against X-Linked-Size rejects it.
    data = make_corpus(50)
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = data
    hub.served[(CORPUS_REPO, "wiki-18.jsonl.gz")] = data[: len(data) // 2]
    out = tmp_path / "out"
    msg = rf"should be of size {len(data)} but has size {len(data) // 2} \(.*wiki-18\.jsonl\.gz\)"
    with pytest.raises(OSError, match=msg):
        download_corpus(corpus_cfg(hub), out)
    assert not leftovers(out, "wiki-18.jsonl.gz")


def test_corrupted_bytes_fail_the_sha256_check(hub, tmp_path):
    data = make_corpus(5)
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = data
    hub.served[(CORPUS_REPO, "wiki-18.jsonl.gz")] = bytes(bad)
    out = tmp_path / "out"
    msg = r"wiki-18\.jsonl\.gz: sha256 is [0-9a-f]{64} but the hub's etag says"
    with pytest.raises(CorpusError, match=msg):
        download_corpus(corpus_cfg(hub), out)
    assert not leftovers(out, "wiki-18.jsonl.gz")


def test_interrupted_transfer_resumes_with_a_range_request(hub, tmp_path):
    # huggingface_hub 2.4.0 resumes only within one call, from the last complete chunk it wrote
    # (DOWNLOAD_CHUNK_SIZE, 10 MiB), so the connection must drop after more than one chunk.
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    n_lines = 45_000
    data = make_corpus(n_lines, compresslevel=0)  # stored, not compressed: about 12 MiB
    assert chunk < len(data) < 2 * chunk
    key = (CORPUS_REPO, "wiki-18.jsonl.gz")
    hub.files[key] = data
    hub.truncate_once[key] = chunk + 1000
    out = tmp_path / "out"
    summary = download_corpus(corpus_cfg(hub, expected_lines=n_lines), out)
    assert (out / "wiki-18.jsonl.gz").read_bytes() == data
    assert summary["corpus"]["lines"] == n_lines
    gets = [r for m, p, r in hub.requests if m == "GET" and p.startswith("/cdn/")]
    assert gets == [None, f"bytes={chunk}-"]


def test_index_parts_are_concatenated_in_order(hub, tmp_path):
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = make_corpus(5)
    parts = {"part_ab": b"B" * 300, "part_aa": b"A" * 500}
    for name, data in parts.items():
        hub.files[(INDEX_REPO, name)] = data
    out = tmp_path / "out"
    cfg = corpus_cfg(hub, index=PrebuiltIndexConfig(enabled=True))
    summary = download_corpus(cfg, out)

    combined = (out / "e5_Flat.index").read_bytes()
    assert combined == parts["part_aa"] + parts["part_ab"]
    index = summary["index"]
    assert index["bytes"] == 800 and [p["name"] for p in index["parts"]] == ["part_aa", "part_ab"]
    assert index["sha256"] == hashlib.sha256(combined).hexdigest()
    assert not (out / STAGING / "part_aa").exists()  # parts are removed once combined

    before = len(hub.requests)
    assert download_corpus(cfg, out)["index"]["status"] == "present"
    assert len(hub.requests) == before


def test_index_expected_bytes_mismatch_leaves_no_index(hub, tmp_path):
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = make_corpus(5)
    hub.files[(INDEX_REPO, "part_aa")] = b"A" * 10
    hub.files[(INDEX_REPO, "part_ab")] = b"B" * 10
    out = tmp_path / "out"
    cfg = corpus_cfg(hub, index=PrebuiltIndexConfig(enabled=True, expected_bytes=21))
    msg = r"e5_Flat\.index: the parts add up to 20 bytes but index\.expected_bytes is 21"
    with pytest.raises(CorpusError, match=msg):
        download_corpus(cfg, out)
    assert not leftovers(out, "e5_Flat.index")
    # The corpus was verified before the index failed, and the manifest says so.
    assert "wiki-18.jsonl.gz" in json.loads((out / MANIFEST).read_text())["files"]


def test_main_loads_the_section_and_overrides(hub, tmp_path, capsys):
    hub.files[(CORPUS_REPO, "wiki-18.jsonl.gz")] = make_corpus(3)
    config = tmp_path / "config.yaml"
    config.write_text(f"corpus:\n  endpoint: {hub.endpoint}\n  expected_lines: 4\n")
    out = tmp_path / "out"
    assert main(str(config), ["expected_lines=3"], str(out)) == 0
    assert "3 lines" in capsys.readouterr().out
    assert main(str(config), [], str(tmp_path / "out2")) == 1  # 3 lines, config says 4


def test_config_is_strict(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("corpus:\n  index:\n    parts: []\n")
    with pytest.raises(ConfigError, match="corpus.index: parts: name at least one part file"):
        load_config(CorpusConfig, config, section="corpus")
    config.write_text("corpus:\n  expected_line: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'expected_lines'"):
        load_config(CorpusConfig, config, section="corpus")
