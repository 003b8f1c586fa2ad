"""Toy tokenizer round trips and backbone save/load through the real-backbone code path."""

import hashlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from a2tgpo.data.prompts import TAGS, build_messages
from a2tgpo.data.world import QASetSpec, WorldConfig, write_world
from a2tgpo.model.backbone import BackboneConfig, load_model, load_tokenizer
from a2tgpo.model.toy import IM_END, PAD, ToyBackboneConfig, write_toy_backbone

SMALL_WORLD = WorldConfig(
    countries=4, cities=8, people=30, films=12, bands=6, companies=8, distractors=10,
    qa_sets=(QASetSpec("s", "single_hop", {"train": 20}, {"single": 1.0}),),
)


@pytest.fixture(scope="module")
def backbone_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy")
    write_world(SMALL_WORLD, root / "world")
    summary = write_toy_backbone(ToyBackboneConfig(), root / "world", root / "backbone")
    return root / "backbone", summary


@pytest.fixture(scope="module")
def tok(backbone_dir):
    return load_tokenizer(BackboneConfig(id="toy", path=str(backbone_dir[0])))


def test_tags_are_single_non_special_tokens(tok):
    for tag in TAGS:
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        # the reward decodes with skip_special_tokens=True; the tags must survive that
        assert tok.decode(ids, skip_special_tokens=True) == tag
    assert tok.decode(tok.encode(IM_END, add_special_tokens=False), skip_special_tokens=True) == ""


@pytest.mark.parametrize("text", [
    "<think> reasoning </think> <search> The Silent Harbor </search>",
    " <result>\nPage 1: \"Veaora\"\nVeaora is a country.\n</result>",
    "<answer> The final answer is \\[ \\boxed{Drouora} \\] </answer>",
    "\\boxed{a {nested} brace}",
    "  leading spaces, tabs\tand\nnewlines  ",
    "unicode: ünïcødé — ✓ 漢字",
])
def test_exact_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_round_trip_any_text(tok, text):
    # byte-level BPE has no unknown token: every string comes back byte for byte
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_chat_template_and_specials(tok):
    text = tok.apply_chat_template(build_messages("who directed it", "a2tgpo"),
                                   add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant")
    assert text.endswith("<|im_start|>user\nwho directed it?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == IM_END and tok.pad_token == PAD and tok.padding_side == "left"


def test_backbone_save_load_same_function(backbone_dir, tok):
    path, summary = backbone_dir
    cfg = BackboneConfig(id="toy", path=str(path), dtype="float32")
    model = load_model(cfg)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    n = sum(p.numel() for p in model.parameters())
    assert n == summary["parameters"] and 1_000_000 <= n <= 5_000_000
    # vocabulary rounded up to a multiple of 64, as Qwen pads its embedding
    assert model.config.vocab_size % 64 == 0
    assert len(tok) <= model.config.vocab_size < len(tok) + 64
    # same seed -> same weights, written twice from scratch
    again = path.parent / "again"
    write_toy_backbone(ToyBackboneConfig(), path.parent / "world", again)
    for name in ("model.safetensors", "tokenizer.json"):
        assert (hashlib.sha256((path / name).read_bytes()).digest()
                == hashlib.sha256((again / name).read_bytes()).digest()), name
    # the reloaded model computes a causal LM forward pass of the right shape
    ids = torch.tensor([tok.encode("Who directed The Silent Harbor?", add_special_tokens=False)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_copy_pretraining_runs_when_asked_and_is_recorded(backbone_dir, tmp_path):
    from a2tgpo.model.copy_pretrain import CopyPretrainConfig

    world = backbone_dir[0].parent / "world"
    cfg = ToyBackboneConfig(copy=CopyPretrainConfig(steps=2, batch_size=2, warmup_steps=1,
                                                    min_accuracy=0.0))
    summary = write_toy_backbone(cfg, world, tmp_path / "b")
    assert [h["step"] for h in summary["copy_pretraining"]["history"]] == [1, 2]
    assert backbone_dir[1]["copy_pretraining"] == {"steps": 0, "history": []}  # the default
    # same seed and sizes: the weights differ from the un-pretrained backbone's
    a = load_model(BackboneConfig(id="a", path=str(backbone_dir[0]), dtype="float32"), "cpu")
    b = load_model(BackboneConfig(id="b", path=str(tmp_path / "b"), dtype="float32"), "cpu")
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight,
                           b.model.layers[0].self_attn.q_proj.weight)


def test_a_failed_copy_stage_is_a_clear_cli_error(backbone_dir, tmp_path, capsys):
    from a2tgpo.cli import main

    world = backbone_dir[0].parent / "world"
    cfg = tmp_path / "tb.yaml"  # 2 updates cannot teach copying: accuracy stays below 0.9
    cfg.write_text("copy: {steps: 2, batch_size: 2, warmup_steps: 1, min_accuracy: 0.9}\n")
    rc = main(["toy-backbone", str(cfg), "--world", str(world), "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "a2tgpo toy-backbone: error: copy pretraining reached held-out repeat accuracy" in err
    assert "toy_backbone.copy.min_accuracy 0.9" in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()  # nothing half-written


def test_model_config_validation():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        ToyBackboneConfig(num_attention_heads=4, num_key_value_heads=3)
