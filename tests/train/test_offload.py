"""train.offload_optimizer: the optimizer state waits in host memory between updates (while the
rollout engine is awake) and training is unchanged by it.

On CPU the state moves between host buffers (DeepSpeed's `offload_states` with the CPU
accelerator), so what this checks is that the offload round trip loses nothing and that
a checkpoint saved while offloaded resumes exactly; the device memory it frees is measured
on a GPU by bench/gpu_probe.py.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from a2tgpo.train.distributed import SingleBackend

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed")
def test_zero2_offload_between_updates_changes_nothing():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("offload_worker.py"))],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    # offloaded at start, reloaded for each update, offloaded after it
    assert r["flags"] == [True] + [False, True] * 4
    assert r["moved"] > 0  # the updates changed the weights (lr 1e-2)
    assert r["norms_offload"] == r["norms_plain"]
    assert r["offload_vs_plain"] == 0.0
    # the state saved while offloaded resumes to the same weights
    assert r["norms_resumed"] == r["norms_plain"][2:]
    assert r["resumed_vs_plain"] == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: on CPU the "
                    "optimizer state is already in host memory and nothing moves")
def test_single_backend_offload_frees_the_moments_on_the_gpu():
    """One process on a GPU: AdamW's two moments (2 x 4 B x 2^22 parameters = 32 MiB) leave the
    device and come back unchanged."""
    torch.manual_seed(0)
    models = [torch.nn.Linear(2048, 2048, bias=False).cuda() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    backends = [SingleBackend(m, torch.optim.AdamW(m.parameters(), lr=0.1), 1.0)
                for m in models]
    x = torch.randn(8, 2048, device="cuda")
    freed = []
    for u in range(3):
        for i, backend in enumerate(backends):
            if i == 1:
                backend.reload_states()
            backend.backward(backend.model(x + u).pow(2).sum())
            backend.step()
            if i == 1:
                before = torch.cuda.memory_allocated()
                backend.offload_states()
                freed.append(before - torch.cuda.memory_allocated())
    assert backends[1].offloaded
    assert freed == [2 * 4 * 2048 * 2048] * 3
    assert torch.equal(models[0].weight, models[1].weight)
