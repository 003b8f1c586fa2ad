"""Backbone loading: one code path for the toy model and for Qwen3-4B / Qwen3-8B / Qwen2.5-7B.

A backbone is a config file in config/backbones/ naming a local directory or a hub id. Both
load through `AutoTokenizer` / `AutoModelForCausalLM`; a hub id is resolved by
huggingface_hub's cache (offline with HF_HUB_OFFLINE=1). Nothing here is toy-specific.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from a2tgpo.config import load_config, option
from a2tgpo.model.fast_decode import attention

log = logging.getLogger(__name__)

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass(frozen=True)
class ArchitectureConfig:
    """The sizes of a model's config.json that memory planning needs (`a2tgpo plan`), written
    in the backbone file so a plan can be made before the weights are downloaded; where the
    config.json is on disk it is read instead, and must agree."""

    model_type: str = option(doc="config.json model_type (qwen3, qwen2, ...).")
    hidden_size: int = option(doc="config.json hidden_size.", ge=1)
    intermediate_size: int = option(doc="config.json intermediate_size (MLP width).", ge=1)
    num_hidden_layers: int = option(doc="config.json num_hidden_layers.", ge=1)
    num_attention_heads: int = option(doc="config.json num_attention_heads.", ge=1)
    num_key_value_heads: int = option(doc="config.json num_key_value_heads.", ge=1)
    head_dim: int = option(doc="Per-head dimension (config.json head_dim, else hidden / heads).",
                           ge=1)
    vocab_size: int = option(doc="config.json vocab_size (rows of the embedding).", ge=1)
    tie_word_embeddings: bool = option(doc="config.json tie_word_embeddings.")


@dataclass(frozen=True)
class BackboneConfig:
    """One policy backbone (config/backbones/<id>.yaml)."""

    id: str = option(doc="Backbone id used in grid paths and tables, e.g. qwen3-4b.")
    path: str = option(doc="Local directory or hub model id (e.g. Qwen/Qwen3-4B).")
    revision: str | None = option(None, "Hub revision (commit, tag or branch); null = default.")
    dtype: Dtype = option("auto", "Weights dtype; auto = bfloat16 on GPU, float32 on CPU.")
    max_model_len: int = option(8192, "Longest sequence (prompt + response) the runs use.", ge=1)
    chat_template: str | None = option(
        None, "Path to a Jinja chat template overriding the tokenizer's; null = keep it."
    )
    enable_thinking: bool | None = option(
        None, "Passed to Qwen3's chat template (its thinking switch); null = do not pass."
    )
    needs_build: bool = option(
        False, "True if the DAG builds this backbone (the toy); false for released models."
    )
    architecture: ArchitectureConfig | None = option(
        None, "The model's config.json sizes for `a2tgpo plan` before the weights are on disk "
        "(null: read config.json from the path or the hub cache).")
    fast_path: bool = option(
        True, "Load and decode through a2tgpo/model/fast_decode.py (an attention that never "
        "copies grouped key/value heads on CPU; the hf engine's KV cache that appends in "
        "place): used only where the installed transformers is a version it was verified "
        "against, else transformers' stock path with a log line. false = always the stock "
        "path (sdpa attention, DynamicCache): the same ids and log-probs, slower.")

    def __post_init__(self) -> None:
        if self.max_model_len < 16:
            raise ValueError("max_model_len must be >= 16")


def load_backbone_config(path: str | Path, overrides=()) -> BackboneConfig:
    return load_config(BackboneConfig, path, overrides)


def read_config_json(cfg: BackboneConfig) -> dict | None:
    """The model's config.json from its local directory or the hub cache, if present."""
    import json

    local = Path(cfg.path) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(cfg.path, "config.json", revision=cfg.revision)
    except ValueError:  # not a hub id either (a local model not built yet)
        return None
    return json.loads(Path(found).read_text()) if isinstance(found, str) else None


def model_context(cfg: BackboneConfig, built_positions: int | None = None
                  ) -> tuple[int, str] | None:
    """(longest sequence the model is made for, where that is stated): for a built (toy)
    backbone `built_positions` (the study's toy_backbone.max_position_embeddings, what the DAG
    builds it with), else its config.json's max_position_embeddings; None where neither is
    known, or where config.json scales RoPE (the engine works the length out)."""
    if cfg.needs_build:
        if built_positions is None:
            return None
        return built_positions, "toy_backbone.max_position_embeddings"
    found = read_config_json(cfg)
    if found is None:
        return None
    text = found.get("text_config", found)
    n = text.get("max_position_embeddings")
    # rope_parameters: transformers 5's files; rope_scaling: the hub's older ones
    rope = text.get("rope_parameters") or {}
    if (not isinstance(n, int) or text.get("rope_scaling")
            or rope.get("rope_type", "default") != "default"):
        return None
    return n, f"max_position_embeddings in the config.json of {cfg.path}"


def resolve_dtype(dtype: Dtype, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def chat_template_kwargs(cfg: BackboneConfig) -> dict:
    """Extra keyword arguments for `tokenizer.apply_chat_template`."""
    return {} if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking}


def load_tokenizer(cfg: BackboneConfig):
    """The backbone's tokenizer, left-padded (generation pads on the left)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.path, revision=cfg.revision, padding_side="left")
    if cfg.chat_template is not None:
        tok.chat_template = Path(cfg.chat_template).read_text()
    if tok.pad_token is None:
        # Qwen tokenizers define <|endoftext|> as pad; others may not
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"backbone {cfg.id}: tokenizer at {cfg.path} has no chat template; "
                         "set chat_template in the backbone config")
    return tok


def load_model(cfg: BackboneConfig, device: str = "cpu"):
    """The causal LM on `device`, in the configured dtype, in eval mode."""
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(cfg.dtype, device)
    log.info("loading %s from %s (%s, %s)", cfg.id, cfg.path, dtype, device)
    # sdpa or its fast variant: torch's flash / memory-efficient kernels where the mask
    # allows, and the 4D masks the IG pass's probes need (rollout/info_gain.py), which
    # flash-attention-2 does not take
    model = AutoModelForCausalLM.from_pretrained(cfg.path, revision=cfg.revision, dtype=dtype,
                                                 attn_implementation=attention(cfg.fast_path))
    return model.to(device).eval()
