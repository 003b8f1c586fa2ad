"""Device memory between the phases of a step, where the trainer and its vLLM engine share a GPU.

The trainer and the engine are two processes on one device. Memory the trainer frees stays
reserved by its CUDA caching allocator, where the engine cannot use it: vLLM's start-up check
and every `wake()` see only the device's free memory (`cudaMemGetInfo`). So the trainer hands
back what it freed at each phase boundary (`release`), and records what it holds there
(`PhaseMemory`): allocated (live tensors), reserved (allocated + the allocator's cache) and
the device's free memory, which is what the engine gets.

Boundaries of a step (rl.py train_step), in order:
  rollout   after the rollouts, the engine asleep
  logprob   after the old / reference / information-gain passes
  update    after the updates (the optimizer state offloaded when `offload_optimizer` is on)
  awake     after the engine woke and took the new weights
On CPU every function is a no-op and no metric is recorded: there is no separate device pool.
"""

from __future__ import annotations

import gc

import torch

GIB = 2**30


def on_cuda(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def release(device) -> None:
    """Collect garbage, wait for the device's queued work, and return the caching allocator's
    free blocks to the device, so that another process (the rollout engine) can take them."""
    gc.collect()
    if on_cuda(device):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def snapshot(device) -> dict[str, float]:
    """{allocated, reserved, device_free, peak_reserved} in GiB on a CUDA device; {} elsewhere.
    peak_reserved: the most the allocator held since the last `reset_peak`."""
    if not on_cuda(device):
        return {}
    free, _total = torch.cuda.mem_get_info(device)
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "device_free_gib": free / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB}


def reset_peak(device) -> None:
    if on_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)


class PhaseMemory:
    """A step's memory record: `boundary(name)` releases the cache and records the snapshot
    under memory/<name>/<key>; `metrics()` returns them (empty on CPU)."""

    def __init__(self, device) -> None:
        self.device = device
        self.values: dict[str, float] = {}
        reset_peak(device)

    def boundary(self, name: str) -> None:
        # the phase's peak before its cache is released: what the phase needed reserved
        peak = snapshot(self.device).get("peak_reserved_gib")
        release(self.device)
        for key, value in snapshot(self.device).items():
            if key != "peak_reserved_gib":
                self.values[f"memory/{name}/{key}"] = value
        if peak is not None:
            self.values[f"memory/{name}/phase_peak_reserved_gib"] = peak
        reset_peak(self.device)

    def metrics(self) -> dict[str, float]:
        return dict(self.values)
