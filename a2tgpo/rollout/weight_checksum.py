"""Checksums that say whether a rollout engine holds the trainer's weights, whatever layout
each keeps them in.

Why weights and not log-probs: in bf16 the engine's and the trainer's log-probs of the same
tokens differ by O(1e-2) (other kernels, other batch shapes), so a log-prob comparison cannot
tell a stale engine from rounding. Weights are compared exactly.

The checksum of a set of tensors is the sum over all their elements of mix(bits), where bits
is the element's float32 bit pattern (bf16 and fp16 widen to float32 exactly) and mix the
splitmix64 finaliser, in wrapping 64-bit arithmetic. Because it is a sum:
  - it ignores layout and order: q, k and v apart give what vLLM's fused qkv_proj gives, gate
    and up what gate_up_proj gives, a weight what its transpose or a packed copy gives, and a
    tensor-parallel shard set what the whole tensor gives;
  - mix(0) = 0, so zero padding (vLLM pads vocabularies to a multiple of 64) adds nothing;
    -0.0 is counted as 0.0 (the identity matmul below returns +0.0 for it);
  - mix is a bijection of 64-bit words, so changing one element always changes the sum;
    several changes cancel only by a 64-bit coincidence.
It does not see a permutation of a tensor's elements (a loader that swapped q and k): that is a
loader bug, which tests/rollout/test_vllm_engine.py's log-prob checks catch in fp32.

vLLM on CPU keeps a linear layer's weight only inside its packed GEMM kernel handle (the weight
parameter is emptied, `dispatch_cpu_unquantized_gemm(remove_weight=True)`); such a weight is
read back as what that kernel computes, the layer's product with the identity matrix, x = I
gives x Wᵀ = Wᵀ exactly (each output is 1·w plus zeros). On GPU every weight is a parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

MASK64 = (1 << 64) - 1
_CHUNK = 1 << 22  # elements per step: bounds the int64 temporaries (32 MiB each)


def _signed(x: int) -> int:
    """x mod 2^64 as a signed 64-bit integer (torch's int64 range)."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


_C1 = _signed(0xBF58476D1CE4E5B9)  # splitmix64's multipliers (odd: bijective mod 2^64)
_C2 = _signed(0x94D049BB133111EB)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _C1
    z = (z ^ _shr(z, 27)) * _C2
    return z ^ _shr(z, 31)


@torch.no_grad()
def tensor_checksum(t: torch.Tensor) -> int:
    """Σ mix(float32 bits) over the elements of `t`, mod 2^64, as a signed int64; computed
    where `t` lives, a chunk at a time."""
    flat = t.detach().reshape(-1)
    total = 0
    for s in range(0, flat.numel(), _CHUNK):
        x = flat[s: s + _CHUNK].float() + 0.0  # -0.0 + 0.0 = +0.0
        words = x.view(torch.int32).to(torch.int64)
        total += int(_mix(words).sum())  # torch's int64 sum wraps: exact mod 2^64
    return _signed(total)


def state_checksum(state: Mapping[str, torch.Tensor]) -> int:
    """The checksum of a state dict's tensors, each storage once (tied weights, e.g. an
    embedding shared with the output layer, appear twice in a state dict and once in vLLM)."""
    seen: set[tuple[int, tuple, int]] = set()
    total = 0
    for t in state.values():
        key = (t.data_ptr(), tuple(t.shape), t.storage_offset())
        if t.numel() == 0 or key in seen:
            continue
        seen.add(key)
        total += tensor_checksum(t)
    return _signed(total)


@torch.no_grad()
def module_checksums(model: torch.nn.Module, rows: int = 1024) -> dict[str, int]:
    """Per parameter of a vLLM model, the checksum of what the engine computes with (runs in
    the engine's worker). An emptied weight of a linear layer is read back through the
    layer's own GEMM (`quant_method.apply` on identity rows, `rows` at a time)."""
    modules = dict(model.named_modules())
    out = {}
    for name, p in model.named_parameters():
        if p.numel() > 0:
            out[name] = tensor_checksum(p)
            continue
        owner, _, attr = name.rpartition(".")
        layer = modules.get(owner)
        method = getattr(layer, "quant_method", None)
        k = getattr(layer, "input_size_per_partition", None)
        if attr != "weight" or method is None or k is None:
            raise RuntimeError(f"cannot read back the engine's parameter {name!r}: it is empty "
                               "and its module has no quant_method/input size to apply")
        total = 0
        for s in range(0, k, rows):
            n = min(rows, k - s)
            eye = torch.zeros(n, k, dtype=p.dtype, device=p.device)
            eye[torch.arange(n), s + torch.arange(n)] = 1  # rows s..s+n of the identity
            total += tensor_checksum(method.apply(layer, eye, bias=None))
        out[name] = _signed(total)
    return out


def combine_workers(per_worker: Iterable[Mapping[str, int]]) -> int:
    """One engine's checksum from its workers' `module_checksums`. With tensor parallelism a
    parameter is either sharded (the workers' sums differ: they add up) or replicated (equal:
    counted once)."""
    per_worker = list(per_worker)
    total = 0
    for name in sorted({n for w in per_worker for n in w}):
        values = [w[name] for w in per_worker if name in w]
        total += values[0] if len(set(values)) == 1 else sum(values)
    return _signed(total)
