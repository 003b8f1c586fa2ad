"""A state dict handed to another process of this machine by handle, not by value: the `ipc`
weight sync of a2tgpo/rollout/vllm_engine.py (its module docstring has the design and the vLLM
source lines it relies on).

`pack` pickles the tensors with torch.multiprocessing's reductions, which write where the data
lives instead of the data: a CUDA tensor as its storage's CUDA IPC handle (plus offset, size,
stride and an event to wait on), a CPU tensor as the file descriptor of its storage in shared
memory. A CPU storage not yet in shared memory is moved there in place by the pickling (torch's
`_share_fd_cpu_`: a new shared allocation, one copy, the old memory freed), so a trainer's
parameters pay that copy on their first sync only and are updated in shared memory afterwards.
`unpack`, in the receiving process, maps the same memory: no tensor data is copied either way.

The payload is a pickle, so `unpack` reads it with an allow-list: torch's own rebuild functions,
the tensor, storage, size and dtype types they take, and multiprocessing's file-descriptor
courier; any other global is refused. A CUDA tensor is rebuilt on the receiver's device index
of the sender's GPU (found by UUID): the receiver may number its GPUs differently
(CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions  # the import registers them with ForkingPickler

REDUCTIONS = "torch.multiprocessing.reductions"
# the globals a pickle of CPU or CUDA tensors names (reductions.reduce_tensor, reduce_storage)
ALLOWED = frozenset({
    *((REDUCTIONS, f) for f in ("rebuild_tensor", "rebuild_typed_storage",
                                "rebuild_typed_storage_child", "rebuild_storage_fd",
                                "rebuild_storage_filename", "rebuild_storage_empty")),
    ("torch", "Tensor"), ("torch", "Size"), ("torch", "UntypedStorage"),
    ("torch", "TypedStorage"), ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"), ("torch.nn.parameter", "Parameter"),
    ("multiprocessing.resource_sharer", "DupFd"),
})


@dataclass(frozen=True)
class Packed:
    """A pickled state dict of handles. `copied`: bytes of CPU storages the pickling moved
    into shared memory (each storage once; 0 once they live there, and always 0 on GPU).
    `cuda_uuid`: the GPU the tensors live on (None for CPU tensors)."""

    payload: bytes
    copied: int
    cuda_uuid: str | None


def pack(state: Mapping[str, torch.Tensor]) -> Packed:
    """Handles to `state`'s tensors, all on one device (CPU or one GPU). The sender must keep
    the tensors alive until the receiver has dropped what it rebuilt from them."""
    items = [(name, t.detach()) for name, t in state.items()]
    devices = {t.device for _, t in items}
    if len(devices) > 1:
        raise ValueError("weight handles: the tensors are on several devices "
                         f"{sorted(map(str, devices))}")
    device = next(iter(devices), torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"weight handles: tensors on {device} cannot be shared by handle")
    copied, seen = 0, set()
    if device.type == "cpu":
        for _, t in items:
            storage = t.untyped_storage()
            if not t.is_shared() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                copied += storage.nbytes()
    uuid = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else None
    buf = io.BytesIO()
    # multiprocessing's pickler: it holds the reductions torch.multiprocessing registers
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(items)
    return Packed(buf.getvalue(), copied, uuid)


def unpack(payload: bytes, cuda_uuid: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a `pack`ed payload, each mapping the sender's memory."""
    return _Unpickler(io.BytesIO(payload), cuda_uuid).load()


def local_cuda_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RuntimeError(f"weight handles: the sending GPU {uuid} is not visible here "
                       f"({torch.cuda.device_count()} GPUs visible)")


def _rebuild_cuda_on(device: int, *args):
    # argument 6 of rebuild_cuda_tensor is the storage's device index (the sender's numbering)
    args = list(args)
    args[6] = device
    return reductions.rebuild_cuda_tensor(*args)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, cuda_uuid: str | None):
        super().__init__(file)
        self.cuda_uuid = cuda_uuid

    def find_class(self, module: str, name: str):
        if (module, name) == (REDUCTIONS, "rebuild_cuda_tensor"):
            if self.cuda_uuid is None:
                raise pickle.UnpicklingError("weight handles: a CUDA tensor without its GPU's "
                                             "UUID")
            return functools.partial(_rebuild_cuda_on, local_cuda_index(self.cuda_uuid))
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"weight handles: {module}.{name} is not a tensor rebuild")
