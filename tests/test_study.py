"""The study config: config/config.yaml validates; errors name the key; schema is generated."""

from pathlib import Path

import pytest
import yaml

from a2tgpo.config import ConfigError, load_config
from a2tgpo.data.world import WorldConfig
from a2tgpo.study import load_study, study_schema, write_section

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)  # backbone files are resolved relative to the repo root


def test_default_config_is_valid():
    study = load_study(ROOT / "config/config.yaml")
    assert study.study == "toy"
    assert study.backbone("toy").needs_build


def test_committed_schema_is_the_generated_one():
    # Snakemake validates with the committed file; it must not drift from the dataclasses
    committed = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    assert committed == yaml.safe_load(yaml.safe_dump(study_schema()))


def test_study_errors(tmp_path):
    cfg = ROOT / "config/config.yaml"
    with pytest.raises(ConfigError, match=r"world\.peeple: unknown key \(did you mean 'people'"):
        load_study(cfg, ["world.peeple=3"])
    with pytest.raises(ConfigError, match=r"backbones\[0\]: no backbone file"):
        load_study(cfg, ["backbones=[nope]"])
    data = yaml.safe_load(cfg.read_text())
    del data["data"]
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=rf"{p}: data: missing required key"):
        load_study(p)


def test_write_section_round_trips(tmp_path):
    out = tmp_path / "world.yaml"
    write_section(ROOT / "config/config.yaml", ["world.seed=5"], "world", out)
    world = load_config(WorldConfig, out)
    assert world.seed == 5 and world == load_study(ROOT / "config/config.yaml",
                                                   ["world.seed=5"]).world
