"""Training backends for the RL update: one process, or data parallel with DeepSpeed ZeRO 1/2/3.

The update loop (rl.py, section 7) talks only to a `Backend`, so the same loop runs in one
process or over many ranks:

    init_distributed()                                   # once per process; at the end
                                                         # backend.close(), shutdown_distributed()
    backend = DeepSpeedBackend(model, torch.optim.AdamW(model.parameters(), lr=...),
                               zero_stage=2, grad_clip=1.0)
    for mini_batch_rows in ...:
        mine = mini_batch_rows[backend.rank::backend.world_size]
        tokens, seqs = local_denominators(loss_mask[mine])
        tokens = backend.all_reduce_sum(tokens)          # the mini-batch's global counts
        seqs = backend.all_reduce_sum(seqs)
        for micro_rows in chunks(mine):
            logits = backend.model(input_ids=ids[micro_rows].to(backend.device), ...).logits
            loss, _ = policy_loss(..., global_tokens=tokens, global_seqs=seqs,
                                  dp_size=backend.world_size)
            backend.backward(loss)                       # accumulates
        grad_norm = backend.step()                       # clip, update, zero grads
        scheduler.step()                                 # a client scheduler still works

Why global counts and dp_size: ZeRO averages gradients over ranks, so each rank's loss is its
share of the mini-batch loss times the number of ranks (`masks.aggregate_loss`); the sum over
micro-batches and the average over ranks is then exactly the loss of the unsplit mini-batch.

Rules under DeepSpeed (all ranks run the same program):
- Every rank makes the same number of `backend.model` forward and `backward` calls per update.
  ZeRO-2/3 reduce gradients inside every backward and ZeRO-3 gathers parameters inside every
  forward; both are collectives, so a rank with one micro-batch fewer hangs the others. When
  rows do not split evenly, give the short rank a micro-batch with an all-zero loss mask (its
  loss and gradient are 0, and it adds nothing to the global counts). The number of
  micro-batches may differ between updates.
- Forward through `backend.model` (the engine), not `backend.unwrapped`: the engine's forward
  prepares ZeRO's gradient accumulation, and under ZeRO-3 the unwrapped module's parameters are
  empty shards outside the engine's hooks. Sampling under ZeRO-3 (HF `generate`) must run on
  every rank in step; use stage 1/2 or a separate rollout engine for that.
- `all_reduce_sum`, `broadcast_object`, `barrier`, `hf_state_dict`, `save_state` and
  `load_state` are collectives: call them on every rank.
- Only the main rank writes run files (checkpoint.py assumes one writer); it gets the weights
  from `hf_state_dict()` and saves them with `backend.unwrapped.save_pretrained(dir,
  state_dict=dict(weights))` (a copy: transformers 5 empties the dict it is given).
  `save_state` writes per-rank files into a directory all ranks can see, so broadcast the
  directory the main rank chose (`broadcast_object`) and `barrier()` before marking the
  checkpoint complete.

Launchers: `init_distributed` reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT,
which the `deepspeed` launcher and `torchrun` both set (the `deepspeed` launcher also passes
`--local_rank=N` to the script, which must accept it). Under `srun`, without those variables,
SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID give the rank, world size and local rank, and
the first host of SLURM_JOB_NODELIST is the master; see `launcher_env`. On CPU, set
`DS_ACCELERATOR=cpu` so DeepSpeed does not look for a GPU; the first DeepSpeed run on a machine
JIT-builds its shared-memory communication op (about 35 s, cached afterwards).
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

# the tag (subdirectory) DeepSpeed's save_checkpoint / load_checkpoint use inside save_state's
# directory
DEEPSPEED_TAG = "deepspeed"
# the file SingleBackend.save_state writes
OPTIMIZER_FILE = "optimizer.pt"
# a port fixed by the job id: every task of an `srun` step computes the same one, and
# concurrent jobs on one node rarely collide
SLURM_PORT_BASE, SLURM_PORT_RANGE = 20000, 20000


class Backend(Protocol):
    """What the training loop needs from its process setup (see the module docstring)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    @property
    def device(self) -> torch.device:
        """Where the inputs of `model` go."""

    @property
    def model(self) -> torch.nn.Module:
        """The module to call forward on (the DeepSpeed engine, or the model itself)."""

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The HF model inside (config, `save_pretrained`); weights are shards under ZeRO-3."""

    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of `loss` (no scaling: pass the loss as it is)."""

    def step(self) -> float:
        """Clip, update, zero the gradients; returns the global gradient norm before clipping."""

    def all_reduce_sum(self, x: float | torch.Tensor) -> float | torch.Tensor: ...

    def broadcast_object(self, obj: Any) -> Any: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full weights as CPU tensors on the main rank, None on the others."""

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's own full weights, where they live (no copy): what its rollout engine
        receives. ZeRO-1/2 keep the full parameters on every rank."""

    def save_state(self, directory: str | Path) -> None:
        """Optimizer state into an existing `directory` (DeepSpeed: with its fp32 weights)."""

    def load_state(self, directory: str | Path) -> None:
        """Restore `save_state`; SingleBackend's weights come from the HF checkpoint instead."""

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------
# process group


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str  # torch.distributed backend: "gloo" (CPU) or "nccl" (GPU)
    device: torch.device


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as `gpu[03-05,07],cpu1`."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, check=True, timeout=30).stdout
        return out.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        # without scontrol: the prefix plus the first number of the first range
        head = nodelist.split(",")[0]
        if "[" not in head:
            return head
        prefix, ranges = head.split("[", 1)
        return prefix + ranges.split(",")[0].split("-")[0].rstrip("]")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT for this
    process.

    Taken as they are when the launcher set RANK (`deepspeed`, `torchrun`; the ranks per node
    from the deepspeed launcher's LOCAL_SIZE, else torchrun's LOCAL_WORLD_SIZE). Otherwise from
    SLURM (`srun`): SLURM_PROCID -> RANK, SLURM_NTASKS -> WORLD_SIZE, SLURM_LOCALID ->
    LOCAL_RANK, SLURM_NTASKS_PER_NODE (or tasks / nodes) -> LOCAL_WORLD_SIZE, the first host
    of SLURM_JOB_NODELIST -> MASTER_ADDR and a port derived from SLURM_JOB_ID -> MASTER_PORT;
    MASTER_ADDR / MASTER_PORT already in the environment win. With neither: one process on
    127.0.0.1 with a free port.
    """
    env = dict(os.environ if environ is None else environ)
    if "RANK" in env:
        out = {"RANK": env["RANK"], "WORLD_SIZE": env.get("WORLD_SIZE", "1"),
               "LOCAL_RANK": env.get("LOCAL_RANK", "0")}
        # the deepspeed launcher's LOCAL_SIZE first: it is written for this launch, while a
        # LOCAL_WORLD_SIZE may be inherited (vLLM's CPU platform sets it in its own process)
        out["LOCAL_WORLD_SIZE"] = env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") \
            or out["WORLD_SIZE"]
    elif "SLURM_PROCID" in env:
        out = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
               "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]  # e.g. "8(x2)"
        nodes = max(1, int(env.get("SLURM_NNODES", "1")))
        out["LOCAL_WORLD_SIZE"] = per_node or str(max(1, int(out["WORLD_SIZE"]) // nodes))
        env.setdefault("MASTER_ADDR", first_slurm_host(env.get("SLURM_JOB_NODELIST",
                                                                "127.0.0.1")))
        job = int(env.get("SLURM_JOB_ID", "0"))
        env.setdefault("MASTER_PORT", str(SLURM_PORT_BASE + job % SLURM_PORT_RANGE))
    else:
        out = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    out["MASTER_ADDR"] = env.get("MASTER_ADDR", "127.0.0.1")
    out["MASTER_PORT"] = env.get("MASTER_PORT") or str(free_port())
    return out


@dataclass(frozen=True)
class EnginePlacement:
    """Where a rank's rollout engine runs and which share of the rollouts it makes.

    Ranks form tensor-parallel groups of `tp` consecutive ranks on one node; the group's first
    rank hosts the engine, on the group's GPUs, and rolls out the group's share (question
    `group` of every `n_groups`); the other ranks of the group roll out nothing.
    """

    hosts_engine: bool
    group: int
    n_groups: int
    devices: tuple[int, ...]  # the engine's GPUs as local indices (empty off the host rank)

    def share(self, items: list) -> list:
        """This rank's items of a list every rank holds in the same order."""
        return items[self.group::self.n_groups] if self.hosts_engine else []


def engine_placement(*, rank: int, local_rank: int, world_size: int, local_world_size: int,
                     tp: int) -> EnginePlacement:
    """The placement of rank `rank` (local rank `local_rank` of `local_world_size` on its node)
    for engines of `tp` GPUs each. A group never spans two nodes."""
    if tp < 1 or local_world_size % tp or world_size % local_world_size:
        raise ValueError(f"rollout_tp={tp} must divide the ranks per node ({local_world_size}), "
                         f"and those the world size ({world_size})")
    if not (0 <= rank < world_size and 0 <= local_rank < local_world_size):
        raise ValueError(f"rank {rank} / local rank {local_rank} outside world {world_size} / "
                         f"node {local_world_size}")
    host = local_rank % tp == 0
    return EnginePlacement(hosts_engine=host, group=rank // tp, n_groups=world_size // tp,
                           devices=tuple(range(local_rank, local_rank + tp)) if host else ())


def use_gpu() -> bool:
    """Train on CUDA when a GPU is visible, unless DS_ACCELERATOR=cpu tells DeepSpeed to use the
    CPU (the process group and DeepSpeed must agree on the device)."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"


def init_distributed(timeout_s: float = 1800.0) -> DistInfo:
    """Join the process group (gloo on CPU, nccl on GPU) as the launcher describes it.

    Idempotent. Exports the variables of `launcher_env` (so DeepSpeed and torch read the same
    ones) and, on GPU, selects the device LOCAL_RANK.
    """
    env = launcher_env()
    os.environ.update(env)
    rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    if use_gpu():
        torch.cuda.set_device(local)
        backend, device = "nccl", torch.device("cuda", local)
    else:
        backend, device = "gloo", torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local,
                    local_world_size=int(env["LOCAL_WORLD_SIZE"]),
                    backend=dist.get_backend(), device=device)


def shutdown_distributed() -> None:
    """Leave the process group, if any (the counterpart of `init_distributed`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# one process


class SingleBackend:
    """The model and optimizer as they are, in this process (no process group needed)."""

    rank, world_size, is_main = 0, 1, True

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 grad_clip: float) -> None:
        self._model, self.optimizer, self.grad_clip = model, optimizer, grad_clip
        self._offloaded: list[tuple[dict, str, torch.device]] = []  # (state, key, device)

    @property
    def device(self) -> torch.device:
        return next(self._model.parameters()).device

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self._model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        """clip_grad_norm_ to `grad_clip` (<= 0: no clipping), AdamW step, grads to None. A
        non-finite gradient norm skips the step (the weights stay finite; the trainer counts
        it against schedule.max_nonfinite_steps)."""
        limit = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._model.parameters(), limit)
        if torch.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def all_reduce_sum(self, x: float | torch.Tensor) -> float | torch.Tensor:
        return x

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return _cpu_copy(self._model.state_dict())

    def offload_states(self) -> None:
        """The optimizer's state tensors (AdamW moments) to host memory, pinned on a GPU,
        until `reload_states`; gradients are already freed (`step` sets them to None)."""
        pin = self.device.type == "cuda"
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != "cpu":
                    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
                    state[key] = host.copy_(value)
                    self._offloaded.append((state, key, value.device))

    def reload_states(self) -> None:
        """Undo `offload_states` (a no-op when nothing is offloaded)."""
        for state, key, device in self._offloaded:
            state[key] = state[key].to(device)
        self._offloaded = []

    @property
    def offloaded(self) -> bool:
        return bool(self._offloaded)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return self._model.state_dict()

    def save_state(self, directory: str | Path) -> None:
        """`directory/optimizer.pt`: the optimizer's state_dict."""
        torch.save(self.optimizer.state_dict(), Path(directory) / OPTIMIZER_FILE)

    def load_state(self, directory: str | Path) -> None:
        self.optimizer.load_state_dict(torch.load(Path(directory) / OPTIMIZER_FILE,
                                                  map_location=self.device, weights_only=True))

    def close(self) -> None:
        pass


def _cpu_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies; tensors shared in `state` (tied embeddings) stay shared."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for key, t in state.items():
        ptr = t.data_ptr()
        if ptr not in copies:
            copies[ptr] = t.detach().to("cpu", copy=True)
        out[key] = copies[ptr]
    return out


# --------------------------------------------------------------------------------------------
# DeepSpeed


def deepspeed_config(*, zero_stage: Literal[1, 2, 3], grad_clip: float,
                     micro_batches_per_step: int = 1, micro_batch_size: int = 1,
                     world_size: int = 1, bf16: bool = False) -> dict:
    """The DeepSpeed config of `DeepSpeedBackend` (no optimizer section: the client's is used).

    `managed_gradient_accumulation: False` makes every `engine.step()` the update, however
    many backward calls came before it, so mini-batches need not hold a fixed number of
    micro-batches. `gradient_accumulation_steps` and the batch sizes then only feed DeepSpeed's
    sample counters. bf16 keeps fp32 master weights in the optimizer; fp32 is used on CPU.

    With bf16, gradients are reduced across ranks in fp32 (`communication_data_type`) and,
    at ZeRO-2/3, accumulated over an update's micro-batches in fp32 (`data_types.
    grad_accum_dtype`: DeepSpeed 0.19.8 keeps an fp32 gradient partition; its default is the
    model's dtype, where a bf16 sum of many micro-batches loses every addend below 2^-8 of
    it, tests/train/ds_bf16_worker.py). ZeRO-1 keeps bf16 accumulation: DeepSpeed answers
    grad_accum_dtype fp32 at stage 1 by swapping in its BF16_Optimizer (another checkpoint
    layout, no offload_states); use ZeRO-2 in bf16.
    """
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    if micro_batches_per_step < 1 or micro_batch_size < 1:
        raise ValueError("micro_batches_per_step and micro_batch_size must be >= 1")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches_per_step,
        "train_batch_size": micro_batch_size * micro_batches_per_step * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": max(grad_clip, 0.0),
        "zero_optimization": {"stage": zero_stage},
        "bf16": {"enabled": bf16},
        # the training loop logs; DeepSpeed's periodic progress lines would only add noise
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["communication_data_type"] = "fp32"
        if zero_stage >= 2:
            config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


class DeepSpeedBackend:
    """Data parallel training with a DeepSpeed ZeRO engine around the client model/optimizer.

    Pass a client `torch.optim.AdamW`: DeepSpeed's own optimizers JIT-build C++/CUDA ops
    (80-90 s on CPU). Joins the process group first if `init_distributed` was not called.

    `save_state(d)` layout (`engine.save_checkpoint(d, tag="deepspeed")`; every rank writes):
        d/deepspeed/mp_rank_00_model_states.pt               ZeRO-1/2: the module (main rank)
        d/deepspeed/zero_pp_rank_{r}_mp_rank_00_model_states.pt   ZeRO-3: rank r's module
        d/deepspeed/zero_pp_rank_{r}_mp_rank_00_optim_states.pt   rank r's optimizer shard
                                                  (fp32 master weights and Adam moments)
        d/zero_to_fp32.py, d/zero_to_torch.py     DeepSpeed's offline merge scripts
    `load_state(d)` restores weights and optimizer together, bit for bit, but only with the
    same world size and ZeRO stage. Neither holds a learning-rate scheduler (the loop owns it).
    Call `load_state` right after construction, before any forward: ZeRO-3 cannot load into an
    engine that has run.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 zero_stage: Literal[1, 2, 3], grad_clip: float,
                 micro_batches_per_step: int = 1, micro_batch_size: int = 1) -> None:
        import deepspeed

        info = init_distributed()
        # DeepSpeed wraps the process group that exists (it would otherwise pick oneCCL on CPU)
        deepspeed.init_distributed(dist_backend=info.backend)
        self.zero_stage = zero_stage
        self.config = deepspeed_config(
            zero_stage=zero_stage, grad_clip=grad_clip,
            micro_batches_per_step=micro_batches_per_step, micro_batch_size=micro_batch_size,
            world_size=info.world_size, bf16=info.device.type == "cuda")
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                               config=self.config)
        self._device = info.device

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def model(self) -> torch.nn.Module:
        return self.engine

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.engine.module

    def backward(self, loss: torch.Tensor) -> None:
        # the loss already carries the global denominators; DeepSpeed's default would also
        # divide it by gradient_accumulation_steps
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        return float(self.engine.get_global_grad_norm())

    def all_reduce_sum(self, x: float | torch.Tensor) -> float | torch.Tensor:
        """Sum over ranks; float in, float out (float64 on the wire, exact for counts)."""
        t = (torch.tensor(float(x), dtype=torch.float64) if not torch.is_tensor(x)
             else x.detach().clone())
        # nccl reduces device tensors only
        wire = t.to(self._device)
        dist.all_reduce(wire, op=dist.ReduceOp.SUM)
        return wire.item() if not torch.is_tensor(x) else wire.to(x.device)

    def broadcast_object(self, obj: Any) -> Any:
        """The main rank's `obj` on every rank (picklable objects)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (picklable objects)."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full weights (in the training dtype) on the main rank, gathered layer by layer under
        ZeRO-3; None on the other ranks."""
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()
            return _cpu_copy(state) if self.is_main else None
        return _cpu_copy(self.engine.module.state_dict()) if self.is_main else None

    def offload_states(self) -> None:
        """The ZeRO optimizer's fp32 master weights, Adam moments and gradient partitions to
        pinned host memory until `reload_states` (DeepSpeed's `offload_states`, ZeRO-1/2),
        which frees 12 B x parameters / ranks of device memory and more for the rollout
        engine; the bf16 weights stay (the engine's weight sync and validation read them)."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        self.engine.offload_states(include=[State.hp_params, State.lp_grads,
                                            State.optim_states],
                                   pin_memory=self._device.type == "cuda")

    def reload_states(self) -> None:
        """Undo `offload_states` (DeepSpeed's `reload_states`; a no-op when nothing is
        offloaded)."""
        if self.engine.optimizer.offloaded_states:
            self.engine.reload_states()

    @property
    def offloaded(self) -> bool:
        return bool(self.engine.optimizer.offloaded_states)

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        if self.zero_stage == 3:
            raise RuntimeError("ZeRO-3 ranks hold parameter shards, not full weights")
        return self.engine.module.state_dict()

    def save_state(self, directory: str | Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, save_latest=False)

    def load_state(self, directory: str | Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory), tag=DEEPSPEED_TAG,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {Path(directory) / DEEPSPEED_TAG}")

    def close(self) -> None:
        """Release the engine's buffers and hooks (the process group stays)."""
        self.engine.destroy()
