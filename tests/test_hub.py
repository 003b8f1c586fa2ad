"""a2tgpo/ops/hub.py: huggingface_hub's own download functions against the local hub.

A folder with one model repo and one dataset repo is served; huggingface_hub 2.4's
snapshot_download, hf_hub_download, list_repo_files and model_info must get exactly the files'
bytes at the commit the hub computes, resume a partial download with a Range request, and fail
as on the real hub (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) for what
the folder does not hold.
"""

import hashlib
import http.client
import json
import logging
import re
import socket
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from a2tgpo.cli import parse_args
from a2tgpo.ops.hub import LocalHub, scan
from a2tgpo.ops.rehearsal import BUILT, rehearse


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "hub"
    model = root / "models/Org/Tiny"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 40)
    (model / "sub/notes.txt").write_text("nested")
    (model / ".hidden").write_text("never served")
    data = root / "datasets/Org/QA/nq"
    data.mkdir(parents=True)
    (data / "test.jsonl").write_text('{"id": "1"}\n')
    return root


@pytest.fixture
def hub(folder, hf_home):
    with LocalHub(folder) as h:
        yield h


def test_commit_is_the_hash_of_the_files(folder):
    before = scan(folder)[("models", "Org/Tiny")]
    assert set(before.files) == {"config.json", "model.safetensors", "sub/notes.txt"}
    assert scan(folder)[("models", "Org/Tiny")].commit == before.commit  # stable
    (folder / "models/Org/Tiny/config.json").write_text('{"model_type": "qwen2"}')
    after = scan(folder)
    assert after[("models", "Org/Tiny")].commit != before.commit
    # the other repo's commit does not move with it
    assert after[("datasets", "Org/QA")].commit == scan(folder)[("datasets", "Org/QA")].commit


def test_empty_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no repos"):
        scan(tmp_path)


def test_huggingface_hub_downloads_the_files(hub, folder, tmp_path):
    repo = hub.repos[("models", "Org/Tiny")]
    info = HfApi(endpoint=hub.url).model_info("Org/Tiny", revision="main")
    assert info.sha == repo.commit
    out = snapshot_download("Org/Tiny", revision=repo.commit, local_dir=tmp_path / "snap",
                            endpoint=hub.url)
    got = {p.relative_to(out).as_posix(): p.read_bytes()
           for p in (tmp_path / "snap").rglob("*") if p.is_file() and ".cache" not in p.parts}
    want = {name: f.path.read_bytes() for name, f in repo.files.items()}
    assert got == want
    files = HfApi(endpoint=hub.url).list_repo_files("Org/QA", repo_type="dataset")
    assert files == ["nq/test.jsonl"]
    path = hf_hub_download("Org/QA", "nq/test.jsonl", repo_type="dataset", endpoint=hub.url,
                           cache_dir=tmp_path / "cache")
    assert open(path).read() == '{"id": "1"}\n'


def test_resumes_with_a_range_request(hub):
    data = (hub.root / "models/Org/Tiny/model.safetensors").read_bytes()
    req = urllib.request.Request(f"{hub.url}/Org/Tiny/resolve/main/model.safetensors",
                                 headers={"Range": "bytes=1000-"})
    with urllib.request.urlopen(req) as r:
        assert r.status == 206
        assert r.headers["Content-Range"] == f"bytes 1000-{len(data) - 1}/{len(data)}"
        assert r.read() == data[1000:]
        # the sha256 etag download-and-verify compares against
        assert r.headers["X-Linked-Etag"].strip('"') == hashlib.sha256(data).hexdigest()


def test_missing_things_fail_as_on_the_hub(hub, tmp_path):
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).model_info("Org/Nope")
    with pytest.raises(RevisionNotFoundError):
        HfApi(endpoint=hub.url).model_info("Org/Tiny", revision="0" * 40)
    with pytest.raises((EntryNotFoundError, RemoteEntryNotFoundError)):
        hf_hub_download("Org/QA", "nq/dev.jsonl", repo_type="dataset", endpoint=hub.url,
                        cache_dir=tmp_path / "cache")
    with pytest.raises((EntryNotFoundError, RemoteEntryNotFoundError)):
        hf_hub_download("Org/Tiny", ".hidden", endpoint=hub.url, cache_dir=tmp_path / "cache")


SIZE = 256 * 40  # model.safetensors in the folder fixture


def _get(hub, path, headers=None, method="GET") -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=5)
    try:
        conn.request(method, path, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


@pytest.mark.parametrize("header, status, content_range, part", [
    ("bytes=0-9", 206, f"bytes 0-9/{SIZE}", slice(0, 10)),
    ("bytes=-10", 206, f"bytes {SIZE - 10}-{SIZE - 1}/{SIZE}", slice(SIZE - 10, SIZE)),
    ("bytes=10000-20000", 206, f"bytes 10000-{SIZE - 1}/{SIZE}", slice(10000, SIZE)),
    ("bytes=-99999", 206, f"bytes 0-{SIZE - 1}/{SIZE}", slice(0, SIZE)),  # more than there is
    # unsatisfiable: starts at or past the end (the 5,000-digit one too), or an empty suffix
    (f"bytes={SIZE}-", 416, f"bytes */{SIZE}", None),
    ("bytes=" + "9" * 5000 + "-", 416, f"bytes */{SIZE}", None),
    ("bytes=-0", 416, f"bytes */{SIZE}", None),
    # malformed
    ("bytes=5-2", 400, None, None),
    ("bytes=x-", 400, None, None),
    ("bytes=-", 400, None, None),
    ("bytes", 400, None, None),
    # ignored (RFC 9110 14.2): another unit, several ranges
    ("items=0-5", 200, None, slice(0, SIZE)),
    ("bytes=0-1,5-6", 200, None, slice(0, SIZE)),
])
def test_ranges(hub, header, status, content_range, part):
    data = (hub.root / "models/Org/Tiny/model.safetensors").read_bytes()
    assert len(data) == SIZE
    got, headers, body = _get(hub, "/Org/Tiny/resolve/main/model.safetensors",
                              {"Range": header})
    assert got == status
    assert headers.get("Content-Range") == content_range
    if part is not None:
        assert body == data[part] and int(headers["Content-Length"]) == len(body)
    else:
        assert json.loads(body)["error"] in ("RangeNotSatisfiable", "BadRequest")
    assert hub.request_count >= 1  # answered, not a dropped connection


def test_symlinks_leaving_the_folder_are_not_served(folder, tmp_path, hf_home, caplog):
    secret = tmp_path / "secret.txt"
    secret.write_text("password")
    model = folder / "models/Org/Tiny"
    (model / "passwd").symlink_to(secret)
    (model / "inside.bin").symlink_to(model / "model.safetensors")  # stays in the folder
    with caplog.at_level(logging.WARNING, logger="a2tgpo.ops.hub"), LocalHub(folder) as hub:
        files = hub.repos[("models", "Org/Tiny")].files
        assert "passwd" not in files and "inside.bin" in files
        status, headers, _ = _get(hub, "/Org/Tiny/resolve/main/passwd")
        assert status == 404 and headers["X-Error-Code"] == "EntryNotFound"
        status, _, body = _get(hub, "/Org/Tiny/resolve/main/inside.bin")
        assert status == 200 and body == (model / "model.safetensors").read_bytes()
        # a served file turned into a link to the outside after the scan: refused too
        (model / "config.json").unlink()
        (model / "config.json").symlink_to(secret)
        status, _, body = _get(hub, "/Org/Tiny/resolve/main/config.json")
        assert status == 404 and b"password" not in body
    assert f"{model / 'passwd'}: not served: it leads to {secret}" in caplog.text
    with LocalHub(folder, follow_symlinks=True) as hub:  # the documented way to allow them
        status, _, body = _get(hub, "/Org/Tiny/resolve/main/passwd")
        assert status == 200 and body == b"password"


def _closed_after(port: int, parts: list[bytes], pause_s: float) -> float:
    """Seconds from connecting until the server closes the connection while we send `parts`
    `pause_s` apart (socket timeout 5 s: a server that never closes fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        start = time.monotonic()
        try:
            for part in parts:
                s.sendall(part)
                time.sleep(pause_s)
            while s.recv(65536):
                pass
        except (BrokenPipeError, ConnectionResetError):  # closed while we were sending
            pass
        return time.monotonic() - start


def test_silent_and_half_sent_connections_are_closed_at_the_timeout(folder):
    """timeout_s 1: a connection that sends nothing, half a head, or a head one byte every
    0.3 s (each read well inside the per-read timeout) is closed about 1 s after it opened,
    and a whole request is still answered."""
    head = b"GET /api/models/Org/Tiny/revision/main HTTP/1.1\r\nHost: t\r\n"
    cases = {"silent": ([], 0.0), "half a head": ([head], 0.0),
             "a byte at a time": ([bytes([b]) for b in head], 0.3)}
    with LocalHub(folder, timeout_s=1.0) as hub, ThreadPoolExecutor(len(cases)) as pool:
        waits = {name: pool.submit(_closed_after, hub.port, *case)
                 for name, case in cases.items()}
        seconds = {name: w.result() for name, w in waits.items()}
        status, _, body = _get(hub, "/api/models/Org/Tiny/revision/main")
    for name, s in seconds.items():
        assert 0.9 < s < 2.5, (name, seconds)
    assert status == 200 and json.loads(body)["id"] == "Org/Tiny"


def test_the_rehearsal_serves_on_loopback_unless_told(folder, tmp_path, caplog):
    """`rehearse` binds 127.0.0.1 by default (the CLI's default too) and says so; its command
    gets an HF_ENDPOINT on 127.0.0.1."""
    assert parse_args(["rehearse", "--", "true"]).host == "127.0.0.1"
    (folder / BUILT).write_text(json.dumps({"passages": 0}))  # a built hub, as far as it asks
    out = tmp_path / "endpoint"
    show = f"import os; open({str(out)!r}, 'w').write(os.environ['HF_ENDPOINT'])"
    with caplog.at_level(logging.INFO, logger="a2tgpo.ops.rehearsal"):
        assert rehearse([sys.executable, "-c", show], hub_dir=folder) == 0
    assert out.read_text().startswith("http://127.0.0.1:")
    assert "rehearsal hub (bound to 127.0.0.1: only jobs on this machine reach it" in caplog.text


def test_the_rehearsal_refuses_a_hub_not_built(folder):
    """`rehearse` serves a hub its build completed (hub.json, written last); `a2tgpo rehearse`
    builds it first (rehearsal_hub.prepare_hub), a caller that did not gets the file named."""
    with pytest.raises(FileNotFoundError, match=re.escape(f"{folder / BUILT}: no such file")):
        rehearse([sys.executable, "-c", "pass"], hub_dir=folder)
