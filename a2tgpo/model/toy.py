"""The toy backbone: a tokenizer trained on the toy world and a tiny Qwen3-architecture LM.

It is saved with `save_pretrained` and loaded back through `AutoTokenizer` /
`AutoModelForCausalLM` by the same code that loads Qwen3-4B (`a2tgpo.model.backbone`). The
tokenizer is byte-level BPE (exact round trip of any text), with Qwen's chat tokens
(`<|im_start|>`, `<|im_end|>`, `<|endoftext|>`) as special tokens and the agent tags as added,
non-special tokens: like Qwen3's `<think>`, they survive `skip_special_tokens=True`, which the
reward relies on. The model's vocabulary is rounded up to a multiple of 64, so (as in Qwen) the
embedding has rows no tokenizer id maps to, and sampling code must cope with that.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from a2tgpo.config import SEED_LIMIT, option
from a2tgpo.data import prompts
from a2tgpo.io import atomic_path, atomic_write_json
from a2tgpo.model.copy_pretrain import CopyPretrainConfig, copy_pretrain

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

# Qwen-style ChatML; the whole agent trajectory is one assistant message (algorithms.md §10.1).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ToyBackboneConfig:
    """Tokenizer and model sizes of the toy backbone (`a2tgpo toy-backbone`)."""

    seed: int = option(0, "Seed of the random weight initialisation.", ge=0, lt=SEED_LIMIT)
    vocab_size: int = option(
        4096, "Target BPE vocabulary (the world's text may support fewer merges).", ge=1
    )
    min_frequency: int = option(2, "Minimum pair frequency for a BPE merge.", ge=1)
    hidden_size: int = option(128, "Model width.", ge=1)
    intermediate_size: int = option(512, "MLP width.", ge=1)
    num_hidden_layers: int = option(4, "Decoder layers.", ge=1)
    num_attention_heads: int = option(4, "Query heads.", ge=1)
    num_key_value_heads: int = option(2, "Key/value heads (grouped-query attention).", ge=1)
    head_dim: int = option(32, "Per-head dimension.", ge=1)
    max_position_embeddings: int = option(2048, "Context length the model supports.", ge=1)
    rope_theta: float = option(10000.0, "RoPE base.", gt=0)
    copy: CopyPretrainConfig = option(
        doc="Copy pretraining of the built model (a2tgpo/model/copy_pretrain.py): the induction "
        "skill that lets it copy names it never saw; steps 0 = off.",
        factory=CopyPretrainConfig)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < 512:
            raise ValueError("vocab_size must be >= 512 (byte alphabet plus specials)")


def training_texts(world_dir: Path) -> Iterator[str]:
    """The world's passages and questions plus the prompt templates, one text at a time."""
    yield prompts.A2TGPO_SYSTEM
    yield prompts.SEARCH_R1_PREFIX
    yield prompts.SEARCH_R1_INVALID
    yield prompts.A2TGPO_RESULT + prompts.SEARCH_R1_INFORMATION + prompts.A2TGPO_EMPTY_RESULT
    yield "<answer> The final answer is \\[ \\boxed{answer} \\] </answer>"
    with open(world_dir / "corpus.jsonl") as f:
        for line in f:
            yield json.loads(line)["contents"]
    for path in sorted((world_dir / "qa").glob("*/*.jsonl")):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                yield row["question"]
                yield " ".join(row["golden_answers"])


def build_tokenizer(cfg: ToyBackboneConfig, texts: Iterator[str]):
    """Train byte-level BPE on `texts`; returns a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in prompts.TAGS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        model_max_length=cfg.max_position_embeddings,
    )


def build_model(cfg: ToyBackboneConfig, tokenizer):
    """A randomly initialised Qwen3ForCausalLM sized by `cfg` (deterministic in cfg.seed)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    vocab = -(-len(tokenizer) // 64) * 64
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        torch_dtype="float32",
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    return model


def write_toy_backbone(cfg: ToyBackboneConfig, world_dir: str | Path, out_dir: str | Path) -> dict:
    """Build tokenizer + model from the world at `world_dir`, copy-pretrain the model when
    `cfg.copy.steps` > 0; save both to `out_dir` atomically."""
    tokenizer = build_tokenizer(cfg, training_texts(Path(world_dir)))
    model = build_model(cfg, tokenizer)
    copy = copy_pretrain(model, tokenizer, cfg.copy)
    with atomic_path(out_dir, directory=True) as tmp:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        summary = {
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokenizer_vocab": len(tokenizer),
            "model_vocab": model.config.vocab_size,
            "layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size,
            "copy_pretraining": copy,
        }
        atomic_write_json(tmp / "a2tgpo_backbone.json", summary)
    return summary
