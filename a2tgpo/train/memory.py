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
On CPU these functions are no-ops and no metric is recorded: there is no separate device pool.

`job_peak` is apart: the whole job's peak memory, the host's and (on GPU) the device's, which
training and evaluation log once at their end.
"""

from __future__ import annotations

import gc
import resource
import sys

import torch

GIB = 2**30

# the most the caching allocator reserved on any device before the last `reset_peak` (bytes):
# PhaseMemory resets the peak at every boundary, and the job's peak must outlive that
_reserved_before_reset = 0


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
    global _reserved_before_reset
    if on_cuda(device):
        _reserved_before_reset = max(_reserved_before_reset,
                                     torch.cuda.max_memory_reserved(device))
        torch.cuda.reset_peak_memory_stats(device)


def job_peak(prefix: str) -> dict[str, float]:
    """This process's peak memory so far, in GiB, as `<prefix>/<key>` metrics:

    host_gib           its peak resident set (getrusage's ru_maxrss)
    host_children_gib  the largest peak resident set of its child processes: the ended ones
                       (getrusage RUSAGE_CHILDREN) and the running ones (VmHWM in
                       /proc/<pid>/status, Linux); 0 without any
    gpu_reserved_gib   where CUDA was used: the most its caching allocator reserved on any
                       device (through `reset_peak`'s resets). An engine in processes of its
                       own (vLLM) is not in it; the device's whole use is in the system/gpu_*
                       metrics.
    """
    # ru_maxrss is in KiB on Linux, in bytes on macOS
    unit = 1 if sys.platform == "darwin" else 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * unit
    for pid in _descendants():
        children = max(children, _peak_rss(pid))
    out = {"host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit / GIB,
           "host_children_gib": children / GIB}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        reserved = max(torch.cuda.max_memory_reserved(i) for i in range(torch.cuda.device_count()))
        out["gpu_reserved_gib"] = max(reserved, _reserved_before_reset) / GIB
    return {f"{prefix}/{k}": v for k, v in out.items()}


def _descendants() -> list[int]:
    try:
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]
    except Exception:  # no psutil, or a process table it cannot read: the ended children only
        return []


def _peak_rss(pid: int) -> int:
    """A running process's peak resident set in bytes (0 where /proc does not say: not Linux,
    or the process ended meanwhile)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # "VmHWM:    1234 kB"
    except (OSError, ValueError, IndexError):
        pass
    return 0


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
