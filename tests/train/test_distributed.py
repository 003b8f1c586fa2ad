"""DeepSpeed ZeRO over 2 processes gives the single-process RL updates (a2tgpo.train.distributed).

ds_worker.py runs 3 updates of a tiny Qwen3 on a fixed synthetic RL batch: once as one process
with SingleBackend, and for ZeRO stages 1, 2 and 3 (one after the other) in 2 processes started
by the real `deepspeed` launcher (CPU, gloo), each rank taking every other row with the global
token / sequence counts. Every stage must give the single process's per-update losses,
gradient norms and final weights; each run must also resume exactly from its saved state and
export HF weights that load back unchanged.

Tolerances. The split runs the same arithmetic in another order (each rank sums its rows, then
ZeRO sums the ranks), so values agree to float32 rounding: losses to 1e-5 absolute (seen:
< 3e-6), gradient norms to 1e-5 relative (seen: ~1e-6). Weights pass through AdamW, whose
step lr·g/(|g| + eps) turns a rounding difference δ in a near-zero gradient into a weight
difference of up to lr·δ/eps: a few weights of ~20k then differ by up to ~1e-5 (eps 1e-6 in
the worker), while a real error (a rank's rows missing, the schedule not applied) moves nearly
every weight by O(lr) = 1e-2. So weights must agree to lr/200 = 5e-5 everywhere and to 1e-6 on
average (seen: < 1e-7). A resume repeats the same arithmetic in the same process: exact.

Time (2 busy cores): about 7 s single, 30-40 s for the launch running the 3 stages; the
first DeepSpeed use on a machine JIT-builds its shared-memory communication op once (35-70 s,
cached in the torch extensions dir), done up front in one process rather than in both ranks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from a2tgpo.train.distributed import (
    deepspeed_config,
    engine_placement,
    launcher_env,
)
from a2tgpo.train.launch import remove_shm_buffers

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed")

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ds_worker.py")
LR = 1e-2  # ds_worker.LR
ZERO_STAGES = (1, 2, 3)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed and the worker's process group use the CPU
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _run(cmd: list[str], timeout: float) -> None:
    """Run `cmd` in its own session; on failure or timeout, fail with its output."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # the launcher's worker processes are in the same new session: end them all
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{out[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _result(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return (json.loads((out / "result.json").read_text()),
            torch.load(out / "weights.pt", weights_only=True))


def _check_self_consistent(result: dict) -> None:
    save_after = len(result["losses"]) - len(result["resumed_losses"])
    assert result["resumed_losses"] == result["losses"][save_after:]
    assert result["resume_max_abs_diff"] == 0.0
    assert result["export_max_abs_diff"] == 0.0


@pytest.fixture(scope="module")
def single_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    _run([sys.executable, str(WORKER), "--out", str(out)], timeout=180)
    return out / "single"


@pytest.fixture(scope="module")
def single(single_out):
    return _result(single_out)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """One launch of 2 ranks runs every stage in turn (start-up costs more than training)."""
    # DeepSpeed's CPU shared-memory op, built (or found in the cache) once in one process
    _run([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
         timeout=400)
    out = tmp_path_factory.mktemp("zero")
    port = str(_free_port())
    try:
        _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
              "--master_port", port, str(WORKER), "--out", str(out),
              "--zero-stages", *map(str, ZERO_STAGES)], timeout=300)
    finally:
        # DeepSpeed's launcher leaves its CPU all-reduce buffers in /dev/shm (`a2tgpo
        # launch` removes its own)
        remove_shm_buffers("127.0.0.1", port)
    return out


@pytest.mark.slow
def test_single_backend_resumes_and_exports(single):
    result, _ = single
    assert result["world_size"] == 1
    _check_self_consistent(result)


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("zero_stage", ZERO_STAGES)
def test_deepspeed_matches_single_process(zero_stage, single, zero_runs):
    (ref, ref_weights), (got, weights) = single, _result(zero_runs / f"zero{zero_stage}")

    assert got["world_size"] == 2
    as_tensor = partial(torch.tensor, dtype=torch.float64)
    torch.testing.assert_close(as_tensor(got["losses"]), as_tensor(ref["losses"]),
                               atol=1e-5, rtol=0, msg=lambda m: f"losses: {m}")
    torch.testing.assert_close(as_tensor(got["grad_norms"]), as_tensor(ref["grad_norms"]),
                               atol=0, rtol=1e-5, msg=lambda m: f"grad norms: {m}")
    assert weights.keys() == ref_weights.keys()
    diff = torch.cat([(weights[k] - ref_weights[k]).abs().flatten() for k in ref_weights])
    assert diff.max() <= LR / 200, f"max weight difference {diff.max():.3g}"
    assert diff.mean() <= 1e-6, f"mean weight difference {diff.mean():.3g}"
    _check_self_consistent(got)


@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("placement", ["zero3", "zero3_offload"])
def test_partitioned_reference_gives_the_full_copys_logprobs(placement, single_out, zero_runs):
    """The reference partitioned by ZeRO-3 over 2 ranks (one rank with an empty micro-batch,
    tied embeddings gathered for the output layer) gives the log-probs of a full frozen copy in
    one process: the same float32 arithmetic on the same weights, so equal to round-off."""
    copy = torch.load(single_out / "reference_copy.pt", weights_only=True)
    got = torch.load(zero_runs / f"reference_{placement}.pt", weights_only=True)
    assert got.shape == copy.shape and copy.abs().sum() > 0
    torch.testing.assert_close(got, copy, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------
# fast: launcher environments and the DeepSpeed config


def test_launcher_env_keeps_launcher_variables():
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29500", "SLURM_PROCID": "7"}
    assert launcher_env(env) == {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                 "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0",
                                 "MASTER_PORT": "29500"}
    # ranks per node: the deepspeed launcher's LOCAL_SIZE (written for this launch) wins over a
    # LOCAL_WORLD_SIZE the process may have inherited; torchrun sets only the latter
    assert launcher_env({**env, "LOCAL_SIZE": "2"})["LOCAL_WORLD_SIZE"] == "2"
    assert launcher_env({**env, "LOCAL_WORLD_SIZE": "2"})["LOCAL_WORLD_SIZE"] == "2"
    assert launcher_env({**env, "LOCAL_SIZE": "2", "LOCAL_WORLD_SIZE": "1"})[
        "LOCAL_WORLD_SIZE"] == "2"


def test_launcher_env_maps_slurm():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[03-05,07],cpu1", "SLURM_JOB_ID": "1234"}
    assert launcher_env(env) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                 "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "gpu03",
                                 "MASTER_PORT": "21234"}
    # 8 tasks on 2 nodes: 4 per node, from SLURM_NTASKS_PER_NODE ("4(x2)") or tasks / nodes
    assert launcher_env({**env, "SLURM_NTASKS_PER_NODE": "4(x2)"})["LOCAL_WORLD_SIZE"] == "4"
    assert launcher_env({**env, "SLURM_NNODES": "2"})["LOCAL_WORLD_SIZE"] == "4"
    # an address or port the job script exported wins
    got = launcher_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "6000"})
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("head", "6000")


def test_launcher_env_without_launcher_is_one_process():
    got = launcher_env({})
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"], got["MASTER_ADDR"]) == \
        ("0", "1", "0", "127.0.0.1")
    assert 0 < int(got["MASTER_PORT"]) < 65536


def test_deepspeed_config():
    cfg = deepspeed_config(zero_stage=3, grad_clip=1.0, micro_batches_per_step=4,
                           micro_batch_size=2, world_size=8, bf16=True)
    assert cfg["train_batch_size"] == 2 * 4 * 8
    assert cfg["zero_optimization"] == {"stage": 3} and cfg["bf16"] == {"enabled": True}
    # the client decides when an update happens, and brings its own optimizer
    assert cfg["managed_gradient_accumulation"] is False and "optimizer" not in cfg
    assert deepspeed_config(zero_stage=1, grad_clip=0.0)["gradient_clipping"] == 0.0
    with pytest.raises(ValueError, match="zero_stage"):
        deepspeed_config(zero_stage=4, grad_clip=1.0)


def test_deepspeed_config_reduces_and_accumulates_bf16_gradients_in_fp32():
    for stage in (2, 3):
        cfg = deepspeed_config(zero_stage=stage, grad_clip=1.0, bf16=True)
        assert cfg["communication_data_type"] == "fp32"
        assert cfg["data_types"] == {"grad_accum_dtype": "fp32"}
    # ZeRO-1: fp32 reduction only (fp32 accumulation would make DeepSpeed swap the optimizer)
    cfg = deepspeed_config(zero_stage=1, grad_clip=1.0, bf16=True)
    assert cfg["communication_data_type"] == "fp32" and "data_types" not in cfg
    # fp32 training: DeepSpeed's defaults are fp32 already
    cfg = deepspeed_config(zero_stage=2, grad_clip=1.0)
    assert "communication_data_type" not in cfg and "data_types" not in cfg


@needs_deepspeed
def test_zero_accumulates_bf16_gradients_in_fp32():
    """A bf16 engine from `deepspeed_config` sums 65 micro-batches' gradients, 1 + 64 x 2^-9,
    in fp32 at ZeRO-2/3: norm 2 x 1.125 = 2.25; DeepSpeed's own default (the control) sums
    them in bf16, where each 2^-9 rounds away: 2.0 (derivation in ds_bf16_worker.py).
    DeepSpeed runs bf16 on CPU, one process."""
    proc = subprocess.run(
        [sys.executable, str(WORKER.with_name("ds_bf16_worker.py")), str(_free_port()),
         "1", "2", "3"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    norms = {(int(line.split()[0]), line.split()[1]): float(line.split()[2])
             for line in proc.stdout.splitlines() if line[:2] in ("1 ", "2 ", "3 ")}
    assert norms == {(2, "config"): 2.25, (3, "config"): 2.25,
                     (1, "config"): 2.0,  # ZeRO-1 keeps bf16 accumulation (see the config)
                     (1, "bf16_default"): 2.0, (2, "bf16_default"): 2.0,
                     (3, "bf16_default"): 2.0}


# --------------------------------------------------------------------------------------------
# rollout engine placement


def test_engine_placement_one_engine_per_rank():
    # tp 1: every rank hosts an engine on its own GPU and rolls out every world-th question
    for rank in range(16):
        p = engine_placement(rank=rank, local_rank=rank % 8, world_size=16, local_world_size=8,
                             tp=1)
        assert (p.hosts_engine, p.group, p.n_groups, p.devices) == (True, rank, 16, (rank % 8,))
    p = engine_placement(rank=3, local_rank=3, world_size=4, local_world_size=4, tp=1)
    assert p.share(list(range(10))) == [3, 7]


def test_engine_placement_tensor_parallel_groups():
    # tp 2 on 2 nodes x 4 ranks: groups {0,1} {2,3} | {4,5} {6,7}; the group's first rank hosts
    # the engine on the group's two local GPUs and rolls out the group's share
    got = [engine_placement(rank=r, local_rank=r % 4, world_size=8, local_world_size=4, tp=2)
           for r in range(8)]
    assert [p.hosts_engine for p in got] == [True, False] * 4
    assert [p.group for p in got] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [p.devices for p in got] == [(0, 1), (), (2, 3), ()] * 2
    qs = list(range(9))
    assert got[4].share(qs) == [2, 6] and got[5].share(qs) == []
    # every question is rolled out exactly once
    assert sorted(q for p in got for q in p.share(qs)) == qs
    with pytest.raises(ValueError, match="rollout_tp=3 must divide the ranks per node"):
        engine_placement(rank=0, local_rank=0, world_size=8, local_world_size=4, tp=3)
