"""The Snakemake DAG: dry runs, config validation before any job, and the toy stages for real."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


@pytest.fixture
def workdir(tmp_path):
    """A copy of the workflow files, so runs never touch the checkout's results/."""
    for name in ("Snakefile", "workflow", "config", "profiles"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    return tmp_path


def smk(workdir, *args, timeout=600):
    # rules call the `a2tgpo` console script of this environment
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run([SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_dry_run_default_config(workdir):
    r = smk(workdir, "-n", "--quiet", "rules")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    for rule in ("world", "toy_backbone", "prepare_data", "resolve_section", "all"):
        assert rule in out
    assert "download_corpus" not in out  # the toy corpus comes from the world


def test_dry_run_hub_corpus_plans_download(workdir):
    r = smk(workdir, "-n", "--quiet", "rules", "--config", "corpus={'source': 'hub'}")
    assert r.returncode == 0, r.stderr
    assert "download_corpus" in r.stdout + r.stderr


@pytest.mark.parametrize("override, needle", [
    ("world={'peeple': 3}", "peeple"),                 # unknown key (schema)
    ("world={'people': 'many'}", "many"),              # wrong type (schema)
    ("backbones=['nope']", "no backbone file"),        # cross-file check (strict loader)
])
def test_invalid_config_fails_before_any_job(workdir, override, needle):
    r = smk(workdir, "-n", "--config", override)
    assert r.returncode != 0
    assert needle in r.stdout + r.stderr
    assert not (workdir / "results").exists()


@pytest.mark.slow
def test_toy_stages_run_and_rerun_is_noop(workdir):
    # shrink the world so this stays a few seconds; the DAG is the same
    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["world"].update(people=40, films=20, companies=10, bands=8, cities=12, distractors=10)
    cfg["world"]["qa_sets"] = [
        {"name": "toy_nq", "group": "single_hop", "splits": {"train": 30, "test": 10},
         "mix": {"single": 1.0}},
        {"name": "toy_hotpotqa", "group": "multi_hop", "splits": {"train": 30, "dev": 10},
         "mix": {"bridge": 0.8, "comparison": 0.2}},
    ]
    cfg["data"]["dev_size"] = 6
    cfg["sft"] = {"epochs": 1, "max_questions": 12, "datasets": ["toy_nq/train"]}
    cfg["data"]["test"] = [t for t in cfg["data"]["test"] if t["name"] in ("toy_nq", "toy_hotpotqa")]
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    r = smk(workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    res = workdir / "results/toy"
    data = json.loads((res / "data/summary.json").read_text())
    assert data["files"]["dev.parquet"]["rows"] == 6
    assert (res / "backbone/model.safetensors").exists()
    assert (res / "sft/model.safetensors").exists()
    assert json.loads((res / "retrieval/recall.json").read_text())["dense"]["n"] > 0
    # nothing changed -> nothing to do
    r = smk(workdir, "-n")
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr
    # a changed world section reruns the world and everything downstream of it
    (workdir / "seed1.yaml").write_text("world: {seed: 1}\n")
    r = smk(workdir, "-n", "--quiet", "rules", "--configfile", "seed1.yaml")
    assert r.returncode == 0, r.stderr
    assert "world" in r.stdout and "prepare_data" in r.stdout
