"""a2tgpo/hub.py: huggingface_hub's own download functions against the local hub.

A folder with one model repo and one dataset repo is served; huggingface_hub 2.4's
snapshot_download, hf_hub_download, list_repo_files and model_info must get exactly the files'
bytes at the commit the hub computes, resume a partial download with a Range request, and fail
as on the real hub (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) for what
the folder does not hold.
"""

import hashlib
import urllib.request

import pytest
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from a2tgpo.hub import LocalHub, scan


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
