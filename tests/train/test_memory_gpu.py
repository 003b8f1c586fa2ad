"""train/memory.py on a GPU: a phase boundary hands what the phase freed back to the device,
where another process (the rollout engine) can take it; the caching allocator alone would keep
it reserved. Skipped without a GPU (on CPU there is no separate device pool)."""

import pytest
import torch

from a2tgpo.train.memory import GIB, PhaseMemory

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_a_boundary_returns_freed_memory_to_the_device():
    device = torch.device("cuda", 0)
    memory = PhaseMemory(device)
    x = torch.empty(2 * GIB, dtype=torch.uint8, device=device)  # a phase's transient
    del x
    # freed, but still held by this process's cache: invisible to other processes
    held = torch.cuda.memory_reserved(device)
    assert held >= 2 * GIB
    free_before = torch.cuda.mem_get_info(device)[0]
    memory.boundary("logprob")
    m = memory.metrics()
    assert torch.cuda.mem_get_info(device)[0] - free_before >= 2 * GIB - 2**20
    assert m["memory/logprob/reserved_gib"] < held / GIB - 1.9
    # the phase's peak is recorded before the release
    assert m["memory/logprob/phase_peak_reserved_gib"] >= 2.0
