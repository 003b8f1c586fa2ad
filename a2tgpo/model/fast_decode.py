"""The fast path: every use of transformers internals, behind a version check.

Two pieces, both used only where the installed transformers is a version they were verified
against (`VERIFIED`) and the backbone's `fast_path` is on; otherwise transformers' stock path,
which gives the same ids and log-probs (tests/rollout/test_hf_engine.py runs its equality
tests on both paths), only slower:

- `attention`: the attention every backbone loads with (`load_model`). `a2tgpo_sdpa`
  (`ATTENTION`) is transformers' `sdpa` except that on CPU grouped-query key/value heads are
  not copied per query head; stock: `sdpa`.
- `new_cache`: the KV cache of the hf engine's decode loop (rollout/hf_engine.py). The fast
  one appends each token's keys and values in place; stock: `DynamicCache`.

transformers copies the whole KV cache at every decoded token in both places (the heads by
`repeat_kv`, the cache by `torch.cat`); bench/decode.py measures each lever against the stock
path. Both subclass or call internals that transformers changes between minor versions
(`DynamicLayer`, `Cache.__init__`'s `layer_class_to_replicate`, `sdpa_attention_forward`,
the attention and mask registries), so another version falls back to the stock path, with one
log line, rather than failing or silently computing something else. Raising the pin in
requirements/common.txt means rerunning the equality tests and widening `VERIFIED`
(tests/model/test_fast_decode.py fails until then).
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

# transformers (major, minor) series the fast path was verified against: the equality tests
# of tests/rollout/test_hf_engine.py pass on both paths (requirements/common.txt pins 5.19.0)
VERIFIED = ((5, 19),)

# transformers' sdpa attention, but grouped-query heads are never copied on CPU (_gqa_sdpa)
ATTENTION = "a2tgpo_sdpa"
STOCK_ATTENTION = "sdpa"


def series(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("5.19.0", "5.20.0.dev0"); None if unreadable."""
    parts = version.split(".")[:2]
    if len(parts) < 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def use_fast_path(requested: bool = True) -> bool:
    """Whether the fast path runs: requested (the backbone's `fast_path`) and verified against
    the installed transformers."""
    if not requested:
        return False
    import transformers

    return _verified(transformers.__version__)


@functools.cache  # one log line per process, not one per model or cache
def _verified(version: str) -> bool:
    if series(version) in VERIFIED:
        return True
    log.warning("transformers %s is not a version the fast decode path was verified against "
                "(%s): using transformers' stock attention and DynamicCache (the same results, "
                "slower; a2tgpo/model/fast_decode.py)", version,
                ", ".join(f"{a}.{b}.x" for a, b in VERIFIED))
    return False


def attention(fast_path: bool = True) -> str:
    """The `attn_implementation` to load a model with: ATTENTION (registered with transformers
    here) on the fast path, else transformers' `sdpa`."""
    return register_attention() if use_fast_path(fast_path) else STOCK_ATTENTION


def new_cache(fast_path: bool = True):
    """An empty KV cache for a forward pass: one that appends in place (`_AppendLayer`) on the
    fast path, else transformers' `DynamicCache`."""
    if use_fast_path(fast_path):
        return _decode_cache_class()()
    from transformers import DynamicCache

    return DynamicCache()


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' `sdpa` attention, except on CPU with a mask and grouped-query heads, where
    torch's `enable_gqa` replaces transformers' copy of each key/value head per query head.
    Shapes: query (B, H, q, d), key/value (B, H_kv, k, d) -> (B, q, H, d).

    transformers copies the heads whenever a mask is given (CUDA's fused kernels take no masked
    GQA); on CPU torch's kernel does, and the copy of the whole KV cache at every decoded token
    was 15% of a toy training run's time (bench/decode.py measures the gain). The output is
    the same to the bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.device.type != "cpu" or attention_mask is None
            or getattr(module, "num_key_value_groups", 1) == 1
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    import torch

    # with a mask, transformers' sdpa is never causal: the mask carries causality
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Register ATTENTION with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _gqa_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # the masks sdpa takes
    return ATTENTION


@functools.cache
def _decode_cache_class():
    """The class, made once (transformers is imported lazily, as everywhere in a2tgpo)."""
    from transformers import DynamicCache
    from transformers.cache_utils import Cache, DynamicLayer

    class _AppendLayer(DynamicLayer):
        """Keys and values are views of buffers with spare columns: a decoded token is written
        into the next column, where `DynamicLayer` copies the whole cache (torch.cat) at every
        token, O(n^2) over a turn (bench/decode.py). Shapes: keys, values (B, H_kv, n, d)."""

        _k = _v = None  # buffers (B, H_kv, capacity, d); keys = _k[:, :, :n]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, m = self.get_seq_length(), key_states.shape[-2]
            # a new buffer when full, or when another method replaced the views
            if (self._k is None or n + m > self._k.shape[-2]
                    or (n and self.keys.data_ptr() != self._k.data_ptr())):
                B, H, _, d = key_states.shape
                cap = 2 * (n + m) + 64
                k, v = key_states.new_empty(B, H, cap, d), value_states.new_empty(B, H, cap, d)
                if n:
                    k[:, :, :n], v[:, :, :n] = self.keys, self.values
                self._k, self._v = k, v
            self._k[:, :, n: n + m], self._v[:, :, n: n + m] = key_states, value_states
            self.keys, self.values = self._k[:, :, : n + m], self._v[:, :, : n + m]
            return self.keys, self.values

        def batch_select_indices(self, indices) -> None:
            n = self.get_seq_length()
            if n and self._k is not None and self.keys.data_ptr() == self._k.data_ptr():
                self._k, self._v = self._k[indices], self._v[indices]
                self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]
            else:
                super().batch_select_indices(indices)

    class _DecodeCache(DynamicCache):
        def __init__(self):
            Cache.__init__(self, layer_class_to_replicate=_AppendLayer)

    return _DecodeCache
