"""The fence around transformers internals (a2tgpo/model/fast_decode.py): the fast path runs
only on a transformers version it was verified against, the pinned one is such a version, and
any other falls back to the stock path with one log line. The equality of the two paths is
tests/rollout/test_hf_engine.py's (every engine test runs on both)."""

import logging
import re
from pathlib import Path

import pytest

from a2tgpo.model import fast_decode

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh_check():
    # the check logs once per process and version: forget what other tests saw
    fast_decode._verified.cache_clear()
    yield
    fast_decode._verified.cache_clear()


def test_series_reads_major_and_minor():
    assert fast_decode.series("5.19.0") == (5, 19)
    assert fast_decode.series("5.20.0.dev0") == (5, 20)
    assert fast_decode.series("5.19") == (5, 19)
    assert fast_decode.series("5") is None and fast_decode.series("main") is None


def test_the_pinned_and_the_installed_transformers_are_verified():
    # raising the pin without rerunning the equality tests on the new version fails here; an
    # unverified install would silently leave the fast path (the default behaviour)
    import transformers

    pin = re.search(r"^transformers==(\S+)", (ROOT / "requirements/common.txt").read_text(),
                    re.MULTILINE)
    assert pin, "requirements/common.txt pins transformers"
    assert fast_decode.series(pin.group(1)) in fast_decode.VERIFIED
    assert fast_decode.series(transformers.__version__) in fast_decode.VERIFIED
    assert fast_decode.use_fast_path() and not fast_decode.use_fast_path(False)


def test_the_verified_version_gets_the_fast_attention_and_cache(fresh_check, caplog):
    from transformers import AttentionInterface, DynamicCache

    with caplog.at_level(logging.WARNING, logger=fast_decode.__name__):
        assert fast_decode.attention(True) == fast_decode.ATTENTION
        cache = fast_decode.new_cache(True)
    assert fast_decode.ATTENTION in AttentionInterface()  # registered for from_pretrained
    assert isinstance(cache, DynamicCache) and type(cache) is not DynamicCache
    assert [r for r in caplog.records if r.name == fast_decode.__name__] == []
    # the switch: the stock path whatever the version
    assert fast_decode.attention(False) == fast_decode.STOCK_ATTENTION == "sdpa"
    assert type(fast_decode.new_cache(False)) is DynamicCache


def test_another_version_falls_back_to_the_stock_path_with_one_log_line(
        fresh_check, monkeypatch, caplog):
    import transformers
    from transformers import DynamicCache

    monkeypatch.setattr(transformers, "__version__", "5.20.0")
    with caplog.at_level(logging.WARNING, logger=fast_decode.__name__):
        for _ in range(3):  # every model load and every cache asks; one line says so
            assert fast_decode.attention(True) == "sdpa"
            assert type(fast_decode.new_cache(True)) is DynamicCache
    [record] = [r for r in caplog.records if r.name == fast_decode.__name__]
    assert record.levelno == logging.WARNING
    assert "transformers 5.20.0" in record.getMessage() and "5.19.x" in record.getMessage()


def test_a_run_resumes_across_the_switch():
    # the stock path gives the fast path's trajectories and a transformers upgrade changes the
    # path without any config change: flipping the key is no reason to train afresh, nor is a
    # checkpoint from before the key existed
    from a2tgpo.train.lineage import identity_changes

    def identity(backbone):
        return {"config": {"backbone": {"id": "toy", **backbone}}, "inputs": {}}

    assert identity_changes(identity({}), identity({"fast_path": True})) == []
    assert identity_changes(identity({"fast_path": True}), identity({"fast_path": False})) == []
    assert identity_changes(identity({"id": "toy"}), identity({"id": "other"})) == [
        "backbone.id: 'toy' -> 'other'"]  # the other backbone keys are still compared
