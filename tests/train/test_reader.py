"""The toy reader: built from its own worlds (never the study's), loadable like a released
backbone, deterministic; a study on one of its worlds is refused before any job."""

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from a2tgpo.config import ConfigError
from a2tgpo.data.world import QASetSpec, WorldConfig
from a2tgpo.model.copy_pretrain import CopyPretrainConfig
from a2tgpo.model.toy import ToyBackboneConfig
from a2tgpo.train.config import SftConfig
from a2tgpo.train.reader import (
    READER_FILE,
    ToyReaderConfig,
    build_reader,
    check_reader_worlds,
    reader_world_seeds,
)

ROOT = Path(__file__).resolve().parents[2]

TINY = ToyReaderConfig(
    worlds=2, seed_stride=7,
    world=WorldConfig(countries=3, cities=6, people=12, films=6, bands=4, companies=4,
                      distractors=4, qa_sets=(
                          QASetSpec("s", "single_hop", {"train": 12}, {"single": 1.0}),
                          QASetSpec("m", "multi_hop", {"train": 6}, {"bridge": 1.0}))),
    backbone=ToyBackboneConfig(vocab_size=512, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=16,
                               copy=CopyPretrainConfig(steps=3, batch_size=4, warmup_steps=1,
                                                       min_accuracy=0.0, eval_batches=1)),
    sft=SftConfig(epochs=1, lr=1e-3, batch_size=16, imperfect_fraction=0.25))


def _weights_sha(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    summary = build_reader(TINY, root / "worlds", root / "reader")
    return root, summary


def test_the_reader_is_built_on_its_own_worlds(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, summary = built
    # worlds k = 1, 2 with seeds k x seed_stride = 7, 14, each generated with that seed
    assert summary["world_seeds"] == [7, 14]
    for seed in (7, 14):
        world = json.loads((root / "worlds" / f"world-{seed}" / "summary.json").read_text())
        assert world["seed"] == seed
    # every question of both worlds is demonstrated once
    questions = sum(sum(1 for _ in p.open()) for seed in (7, 14)
                    for p in (root / "worlds" / f"world-{seed}" / "qa").glob("*/*.jsonl"))
    assert summary["demonstrations"]["total"]["demos"] == questions
    assert set(summary["demonstrations"]["per_world"]) == {"world-7", "world-14"}
    # the copy stage ran (3 updates) and its record is kept
    assert summary["copy_pretraining"]["steps"] == 3
    out = root / "reader"
    assert json.loads((out / READER_FILE).read_text())["world_seeds"] == [7, 14]
    assert reader_world_seeds(out) == [7, 14]
    # loadable as a released backbone is
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.num_hidden_layers == 1 and len(tok) == summary["tokenizer_vocab"]


def test_the_build_is_deterministic(built, tmp_path):
    root, _ = built
    build_reader(TINY, root / "worlds", tmp_path / "again")
    assert _weights_sha(tmp_path / "again") == _weights_sha(root / "reader")
    # and the SFT seed matters: a different one gives different weights
    other = ToyReaderConfig(**{**TINY.__dict__, "sft": SftConfig(
        epochs=1, lr=1e-3, batch_size=16, imperfect_fraction=0.25, seed=1)})
    build_reader(other, root / "worlds", tmp_path / "other")
    assert _weights_sha(tmp_path / "other") != _weights_sha(root / "reader")


def test_a_study_on_a_reader_world_is_refused(tmp_path):
    reader = tmp_path / "reader"
    reader.mkdir()
    (reader / READER_FILE).write_text(json.dumps({"world_seeds": [1000, 2000]}))
    check_reader_worlds(reader, 0, "c.yaml")  # another world: fine
    check_reader_worlds(tmp_path, 1000, "c.yaml")  # not a reader: nothing to check
    with pytest.raises(ConfigError, match=r"c\.yaml: world\.seed 2000 is one of the worlds"):
        check_reader_worlds(reader, 2000, "c.yaml")


def test_check_study_refuses_a_reader_pretrained_on_the_study_world(tmp_path, monkeypatch):
    from a2tgpo.study import load_study
    from a2tgpo.study_checks import check_study

    monkeypatch.chdir(ROOT)
    reader = tmp_path / "reader"
    reader.mkdir()
    (reader / READER_FILE).write_text(json.dumps({"world_seeds": [0, 1000]}))
    # a saved model's folder (the load-time check of a backbone path wants its config.json)
    (reader / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    bdir = tmp_path / "backbones"
    bdir.mkdir()
    (bdir / "r.yaml").write_text(yaml.safe_dump({"id": "r", "path": str(reader),
                                                 "dtype": "float32", "max_model_len": 2048}))
    overrides = [f"backbones_dir={bdir}", "backbones=[r]", "grid.default=[main]",
                 "grid.sets={main: {methods: [grpo], seeds: [1]}}", "sweeps=[]"]
    with pytest.raises(ConfigError, match=r"backbone r: world\.seed 0 is one of the worlds"):
        check_study(load_study(ROOT / "config/config.yaml", overrides), "config.yaml",
                    plan=False)
    check_study(load_study(ROOT / "config/config.yaml", overrides + ["world.seed=5"]),
                "config.yaml", plan=False)


def test_the_shipped_reader_is_what_the_study_section_rebuilds():
    # assets/toy-reader is the default study's starting policy; its record must hold the
    # study's own toy_reader section (so `a2tgpo toy-reader config/config.yaml --section
    # toy_reader` rebuilds it), worlds the study does not use, and load like a released model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from a2tgpo.config import to_dict
    from a2tgpo.study import load_study

    study = load_study(ROOT / "config/config.yaml")
    backbone = study.backbone("toy_reader")
    assert backbone.path == "assets/toy-reader" and not backbone.needs_build
    folder = ROOT / backbone.path
    record = json.loads((folder / READER_FILE).read_text())
    assert record["config"] == to_dict(study.toy_reader)
    assert record["world_seeds"] == study.toy_reader.world_seeds()
    assert study.world.seed not in record["world_seeds"]
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert sum(p.numel() for p in model.parameters()) == record["parameters"]
    assert len(tok) == record["tokenizer_vocab"]
