"""`a2tgpo fetch-backbone` against a local stand-in for the Hugging Face Hub (no network).

`ModelHub` serves a local folder laid out like a hub model repo (config.json, tokenizer files,
a safetensors index and its shards, plus a .bin copy that must not be fetched) at one commit,
answering what huggingface_hub 2.4.0's `model_info` and `snapshot_download` ask:

- `GET /api/models/{repo}/revision/{rev}`: {"id", "sha", "siblings"} (rev: main or the commit)
- `GET /api/models/{repo}/tree/{commit}`: the file list with sizes and git oids
- `HEAD` / `GET /{repo}/resolve/{commit}/{file}`: the metadata headers / the bytes
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer
from a2tgpo.model.fetch import FETCHED, FetchError, fetch_backbone
from a2tgpo.model.toy import ToyBackboneConfig, build_model, build_tokenizer

REPO = "Org/Tiny-Qwen3"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/revision/(?P<rev>[^/]+)$")
TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(/.*)?$")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class ModelHub:
    def __init__(self, folder: Path) -> None:
        self.files = {str(p.relative_to(folder)): p.read_bytes()
                      for p in sorted(folder.rglob("*")) if p.is_file()}
        self.requests: list[tuple[str, str]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_HEAD(self):
                hub._handle(self, body=False)

            def do_GET(self):
                hub._handle(self, body=True)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)

    def _handle(self, req, *, body):
        path = unquote(urlparse(req.path).path)
        self.requests.append((req.command, path))
        if m := INFO.match(path):
            if m["repo"] != REPO or m["rev"] not in ("main", COMMIT):
                return self._send(req, 404, {"X-Error-Code": "RevisionNotFound"}, b"{}")
            return self._json(req, {"id": REPO, "sha": COMMIT,
                                    "siblings": [{"rfilename": f} for f in self.files]})
        if m := TREE.match(path):
            return self._json(req, [{"type": "file", "path": f, "size": len(d),
                                     "oid": hashlib.sha1(d).hexdigest()}
                                    for f, d in self.files.items()])
        if (m := RESOLVE.match(path)) and m["file"] in self.files and m["rev"] == COMMIT:
            data = self.files[m["file"]]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}
            return self._send(req, 200, headers, data if body else b"", length=len(data))
        return self._send(req, 404, {"X-Error-Code": "EntryNotFound"}, b"")

    def _json(self, req, obj):
        self._send(req, 200, {"Content-Type": "application/json"}, json.dumps(obj).encode())

    @staticmethod
    def _send(req, status, headers, payload, length=None):
        req.send_response(status)
        for k, v in headers.items():
            req.send_header(k, v)
        req.send_header("Content-Length", str(len(payload) if length is None else length))
        req.end_headers()
        req.wfile.write(payload)


@pytest.fixture
def hub(tmp_path, hf_home):
    """A tiny Qwen3-architecture model saved in several safetensors shards, as a hub repo."""
    repo = tmp_path / "repo"
    tiny = ToyBackboneConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=16, max_position_embeddings=64)
    tok = build_tokenizer(tiny, iter(["a b c d e f g"] * 4))
    model = build_model(tiny, tok)
    model.save_pretrained(repo, max_shard_size="40KB")  # several shards + an index
    tok.save_pretrained(repo)
    (repo / "pytorch_model.bin").write_bytes(b"a duplicate in another format")
    fake = ModelHub(repo)
    fake.thread.start()
    yield fake, model
    fake.server.shutdown()
    fake.server.server_close()


def test_fetches_the_loadable_files_at_the_pinned_commit(hub, tmp_path):
    fake, model = hub
    out = tmp_path / "models" / "tiny"
    cfg = BackboneConfig(id="tiny", path=REPO, revision=COMMIT, dtype="float32")
    record = fetch_backbone(cfg, out, endpoint=fake.endpoint)
    assert (record["repo"], record["commit"]) == (REPO, COMMIT)
    shards = [f for f in fake.files if f.endswith(".safetensors")]
    assert len(shards) > 1
    # everything a model is loaded from, nothing else (the .bin copy stays on the hub)
    assert set(record["files"]) == set(fake.files) - {"pytorch_model.bin"}
    assert {f: (out / f).read_bytes() for f in record["files"]} == {
        f: fake.files[f] for f in record["files"]}
    assert json.loads((out / FETCHED).read_text()) == record
    assert not (out / ".cache").exists() and not list(tmp_path.glob("models/.*"))
    # jobs load the folder with the hub offline: same weights as the repo's model
    loaded = load_model(BackboneConfig(id="tiny", path=str(out), dtype="float32"), "cpu")
    assert load_tokenizer(BackboneConfig(id="tiny", path=str(out))).vocab_size > 0
    want = model.state_dict()
    assert all((loaded.state_dict()[k] == v).all() for k, v in want.items())

    # a second fetch of the same pin asks the hub nothing
    before = len(fake.requests)
    assert fetch_backbone(cfg, out, endpoint=fake.endpoint) == record
    assert len(fake.requests) == before


def test_an_unpinned_revision_is_resolved_once_with_a_warning(hub, tmp_path, caplog):
    fake, _ = hub
    cfg = BackboneConfig(id="tiny", path=REPO, dtype="float32")  # revision: null = main
    with caplog.at_level(logging.WARNING, logger="a2tgpo.model.fetch"):
        record = fetch_backbone(cfg, tmp_path / "m", endpoint=fake.endpoint)
    assert (record["revision"], record["commit"]) == ("main", COMMIT)
    assert f"pin it (revision: {COMMIT}" in caplog.text


def test_a_missing_shard_is_an_error_and_nothing_is_left_in_place(hub, tmp_path):
    fake, _ = hub
    shard = next(f for f in fake.files if f.endswith(".safetensors"))
    del fake.files[shard]  # listed in the index, absent from the repo
    cfg = BackboneConfig(id="tiny", path=REPO, revision=COMMIT)
    with pytest.raises(FetchError, match=f"not fetched: \\['{shard}'\\]"):
        fetch_backbone(cfg, tmp_path / "m", endpoint=fake.endpoint)
    assert not (tmp_path / "m").exists()
