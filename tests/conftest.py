"""Shared test setup: GPU tests skip with a reason where no CUDA device is visible; a copy of
the workflow files for tests that run Snakemake; huggingface_hub pointed at a private home."""

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    """huggingface_hub with a home under tmp_path: no real cache, no token, online.
    It reads these at import time, so its constants are patched as well as the environment."""
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return home


@pytest.fixture
def workdir(tmp_path):
    """A copy of the workflow files, so Snakemake runs never touch the checkout."""
    for name in ("Snakefile", "workflow", "config", "profiles"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    (tmp_path / "assets").symlink_to(ROOT / "assets")  # the shipped toy reader, read-only
    return tmp_path


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
