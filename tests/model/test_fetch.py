"""`a2tgpo fetch-backbone` against the local hub (a2tgpo/ops/hub.py; no network).

The hub serves a folder laid out like a hub model repo (config.json, tokenizer files, a
safetensors index and its shards, plus a .bin copy that must not be fetched) at the commit its
files hash to, answering what huggingface_hub 2.4.0's `model_info` and `snapshot_download` ask.
"""

from __future__ import annotations

import json
import logging

import pytest

from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer
from a2tgpo.model.fetch import FETCHED, FetchError, fetch_backbone
from a2tgpo.model.toy import ToyBackboneConfig, build_model, build_tokenizer
from a2tgpo.ops.hub import LocalHub

REPO = "Org/Tiny-Qwen3"


class Hub:
    """The served repo: its files, its commit, the endpoint and the requests seen."""

    def __init__(self, hub: LocalHub) -> None:
        repo = hub.repos[("models", REPO)]
        self.files = {name: f.path.read_bytes() for name, f in repo.files.items()}
        self.commit, self.endpoint, self.hub = repo.commit, hub.url, hub

    def requests(self) -> int:
        return self.hub.request_count


@pytest.fixture
def hub(tmp_path, hf_home):
    """A tiny Qwen3-architecture model saved in several safetensors shards, as a hub repo."""
    repo = tmp_path / "hub/models" / REPO
    tiny = ToyBackboneConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=16, max_position_embeddings=64)
    tok = build_tokenizer(tiny, iter(["a b c d e f g"] * 4))
    model = build_model(tiny, tok)
    model.save_pretrained(repo, max_shard_size="40KB")  # several shards + an index
    tok.save_pretrained(repo)
    (repo / "pytorch_model.bin").write_bytes(b"a duplicate in another format")
    yield repo, model


@pytest.fixture
def served(hub):
    repo, model = hub
    with LocalHub(repo.parents[2]) as h:
        yield Hub(h), model


def test_fetches_the_loadable_files_at_the_pinned_commit(served, tmp_path):
    fake, model = served
    commit = fake.commit
    out = tmp_path / "models" / "tiny"
    cfg = BackboneConfig(id="tiny", path=REPO, revision=commit, dtype="float32")
    record = fetch_backbone(cfg, out, endpoint=fake.endpoint)
    assert (record["repo"], record["commit"]) == (REPO, commit)
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
    before = fake.requests()
    assert before > 0
    assert fetch_backbone(cfg, out, endpoint=fake.endpoint) == record
    assert fake.requests() == before


def test_an_unpinned_revision_is_resolved_once_with_a_warning(served, tmp_path, caplog):
    fake, _ = served
    commit = fake.commit
    cfg = BackboneConfig(id="tiny", path=REPO, dtype="float32")  # revision: null = main
    with caplog.at_level(logging.WARNING, logger="a2tgpo.model.fetch"):
        record = fetch_backbone(cfg, tmp_path / "m", endpoint=fake.endpoint)
    assert (record["revision"], record["commit"]) == ("main", commit)
    assert f"pin it (revision: {commit}" in caplog.text


def test_a_missing_shard_is_an_error_and_nothing_is_left_in_place(hub, tmp_path):
    repo, _ = hub
    shard = sorted(repo.glob("*.safetensors"))[0]
    shard.unlink()  # listed in the index, absent from the repo
    with LocalHub(repo.parents[2]) as h:
        fake = Hub(h)
        cfg = BackboneConfig(id="tiny", path=REPO, revision=fake.commit)
        with pytest.raises(FetchError, match=f"not fetched: \\['{shard.name}'\\]"):
            fetch_backbone(cfg, tmp_path / "m", endpoint=fake.endpoint)
    assert not (tmp_path / "m").exists()


def test_model_id_error_without_the_network(tmp_path, monkeypatch):
    from a2tgpo.model.fetch import model_id_error

    monkeypatch.chdir(tmp_path)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved/config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for ok in ("intfloat/e5-base-v2", "Qwen/Qwen3-4B", "saved", "./saved", str(tmp_path / "saved")):
        assert model_id_error(ok) is None, ok
    assert model_id_error("minilm", builtin=("minilm",)) is None
    assert "of the form owner/name" in model_id_error("minilm")  # not built in: a hub id
    assert model_id_error("empty") == "local directory empty has no config.json (not a saved model)"
    assert model_id_error("./e5") == "no such local directory: ./e5"  # never a hub id
    assert model_id_error("../e5") == "no such local directory: ../e5"
    assert model_id_error("/nonexistent/e5") == "no such local directory: /nonexistent/e5"
    assert "~ is not expanded" in model_id_error("~/e5")
    # the hub's own rules: one slash, no '--', at most 96 characters per part
    for bad in ("a/b/c", "intfloat/e5--base", "intfloat/" + "e" * 97, "intfloat/e5 base"):
        assert model_id_error(bad).startswith("neither a local directory nor a hub id: "), bad
