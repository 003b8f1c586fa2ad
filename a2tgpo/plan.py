"""Memory, compute and disk plan of a study's cells, before any job starts (`a2tgpo plan`).

For each cell the plan adds up, per rank, what a training job holds in device memory in each of
the three phases of a step (rl.py):

  rollout   the resident training state + the rollout engine awake (vLLM: its memory share of
            the GPU; the hf engine: the KV cache of a generation wave) + an in-process index;
  logprob   the resident state + the engine asleep + the largest no-grad pass: the fused IG /
            old-log-prob pass (KV cache of ig_batch_size trajectories) or the old / reference
            pass of one micro-batch;
  update    the resident state + the engine asleep + gradients + the activations of one update
            micro-batch (with or without gradient checkpointing) + the chunked log-prob buffers.

The resident state is the weights, the optimizer shard (ZeRO stage; in host memory from after
one update to the next with `train.offload_optimizer`, so not in the rollout and logprob
phases), the reference policy of KL methods (`train.reference`) and ZeRO's communication
buckets.

The cell fits when the largest phase is within `train.gpu_memory_gb` (GPU cells) or the job's
memory request (CPU cells, all ranks of the job together), and the job's host memory (below)
within its request. The DAG refuses a study with a cell that does not fit, naming the
cell and its largest term (workflow/rules/common.smk).

On a GPU the terms are what a phase holds reserved by the trainer's CUDA caching allocator,
which is what the engine sharing the GPU cannot use: the trainer empties its cache at every
phase boundary (a2tgpo/train/memory.py), so a phase reserves its own tensors plus an allocator
reserve (RESERVED_SLACK of its passes' terms), never a previous phase's peak.

How each term is computed (b = bytes per weight/activation element: 2 in bf16, 4 in fp32;
P = parameters, W = ranks, T = tokens of a pass, h/q/k/i = hidden, query (heads x head_dim),
key/value (kv heads x head_dim) and MLP widths, V = vocabulary, c = log-prob chunk tokens):
  weights P·b; optimizer (DeepSpeed ZeRO-1/2, fp32 master weights + Adam moments) 12·P/W,
  (one process, torch AdamW moments in the weights' dtype) 2·P·b; gradients ZeRO-2 P·b/W,
  ZeRO-1 P·b, one process P·b, plus the fp32 gradient partition of the step 4·P/W (DeepSpeed);
  ZeRO buckets 2 x min(5e8, P) x b (DeepSpeed's default reduce and all-gather bucket sizes);
  reference copy P·b, zero3 P·b/W + the largest tensor gathered, zero3_offload that tensor.
  Activations saved per token and layer (HF Qwen2/Qwen3 decoder layers, sdpa attention
  without an L x L score matrix): two RMSNorms 4h, the attention's q-sized tensors 7q (q, its
  norm, the rotated q, k and v repeated to q's size for grouped-query attention, the output
  and the o_proj input), k and its norm 2k, the MLP 4i: a = 4h + 7q + 2k + 4i; plus the
  attention mask the layer converts and keeps, rows x L^2 elements (<= T x L, L the longest
  row). Without checkpointing the update keeps every layer's; with it, only the layer inputs
  layers·T·h·b. The backward peak is the larger of the log-prob chunk's backward (12 B per
  element of c·V; an entropy adds 8) with the output layer's gradient before it is
  accumulated, and one layer's backward: its activation gradients T·(2i + 2h)·b, and under
  checkpointing the layer recomputed. A no-grad pass holds the final hidden states and the
  larger of one layer's working set T·(2h + 2q + 2k + 3i + L)·b and a forward log-prob chunk
  (the chunks run after the decoder); the IG pass adds its KV cache 2·layers·k·b per token.
Validated on CPU by bench/plan_memory.py: for scaled Qwen3 models (42-45M parameters, 4k
tokens) the pass terms are 0.78-0.96 of the measured peaks. The constants that are estimates,
not derivations, are named below with their reasoning.

Host memory of a job (its `mem_mb` request; train.mem_mb / eval.mem_mb null = this plan x
HOST_HEADROOM): every process's runtime (PROCESS_HOST_BYTES: trainer, vLLM engine, the job's
retrieval server), on GPU jobs the policy weights passing through host memory per rank (loaded
there before moving to the GPU; the asleep engine's weights offloaded there), on CPU jobs the
device plan itself, and the job's own retrieval server (retrieval.http.serve: job): faiss reads
the whole index file into RAM, then on a GPU job (retrieval.index.gpu on/auto, faiss-gpu) shards
its vectors in fp16 over the job's GPUs, a term of every phase of every GPU. Evaluation jobs get
the same two checks (`EvalPlan`): their engine's share of the GPU plus the server's shard.

Tokens, time and disk: tokens per step from an assumed mean trajectory length; seconds per
step and GPU-hours from a2tgpo/timing.py's step-time model on the study's `train.gpu_model`
(the agent loop on a simulated engine with the cell's schedule, the passes from FLOPs at
`Assumptions.train_mfu`); checkpoint disk from the schedule (HF weights per kept checkpoint,
optimizer state in the newest `optimizer_states`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from a2tgpo.config import ConfigError
from a2tgpo.io import atomic_write_json
from a2tgpo.model.backbone import ArchitectureConfig, BackboneConfig, read_config_json
from a2tgpo.study import encoder_dir, index_file, resolve_cell, study_cache, study_cells
from a2tgpo.train.checkpoint import SAVE_SHARD_BYTES

log = logging.getLogger(__name__)

GIB = 2**30
# DeepSpeed ZeRO-1/2 defaults: reduce_bucket_size and allgather_bucket_size, 5e8 elements each
ZERO_BUCKET_ELEMENTS = 5e8
# estimate: the CUDA context of the trainer and of the engine process (~0.5 GiB each) plus
# the caching allocator's fragmentation at these sizes
CUDA_OVERHEAD_BYTES = 2.0 * GIB
# estimate: what the trainer's CUDA caching allocator reserves beyond what a phase's passes
# allocate (block rounding, and segments split by tensors of other sizes: packed micro-batches
# differ in length), as a share of the phase's pass terms; resident tensors (weights,
# optimizer, buckets) are single large blocks and add nothing. Released at every phase
# boundary (a2tgpo/train/memory.py), so it never carries into the engine's phase. To be
# calibrated by bench/gpu_probe.py (memory/<phase>/phase_peak_reserved_gib vs the plan).
RESERVED_SLACK = 0.25
# estimate: what a vLLM engine keeps asleep at level 1 (weights offloaded, KV cache freed):
# its CUDA graphs and sampler buffers
ENGINE_ASLEEP_BYTES = 1.0 * GIB
# vLLM's CPU KV cache when neither VLLM_CPU_KVCACHE_SPACE nor engine_kv_cache_gb is set
VLLM_CPU_KV_BYTES = 4.0 * GIB
REFUSAL_LINES = 12  # cells named in the DAG's refusal (the plan lists them all)
# estimate: host RAM of one process of a job beyond the tensors the plan counts. CPU: the
# imports (measured: 0.24 GiB with torch and transformers, 0.42 GiB with vLLM) and working
# buffers; GPU: the CUDA runtime and its libraries (cuBLAS, NCCL), pinned staging buffers
PROCESS_HOST_BYTES = {False: 1.0 * GIB, True: 3.0 * GIB}
# train.weight_sync bytes: host copies of the model per rank while a sync is in transit. Measured
# on vLLM CPU (tests/rollout/test_weight_sync.py, a 382 MB model): 4.77x (torch.save's bytes,
# the engine core's message frames, torch.load's tensors, vLLM's reload); on GPU the trainer's
# `.cpu()` copy comes first: + 1 (an estimate). weight_sync ipc adds none on GPU.
BYTES_SYNC_HOST_COPIES = 4.77 + 1.0
# estimate: a retrieval server's share of each GPU it shards the index over, besides the
# vectors: faiss-gpu's temporary memory (1.5 GiB by default) and the server's CUDA context
FAISS_GPU_EXTRA_BYTES = 2.0 * GIB
# a derived memory request (mem_mb null): the planned host memory x this, for what the plan
# does not see (allocator fragmentation, page cache the cgroup charges)
HOST_HEADROOM = 1.25
MIB = 2**20


@dataclass(frozen=True)
class Assumptions:
    """Numbers the plan cannot know from the config; each is an assumption, printed with the
    plan. Lengths (tokens per step): the papers' multi-hop spread as bench/padding.py draws it
    (prompt ~300 tokens, 3 calls of ~375 generated + ~425 observation tokens, an answer turn of
    ~250). Time: a2tgpo/timing.py's step-time model (its rollouts drawn from `shape`) on the
    study's `train.gpu_model`; `peak_tflops` replaces that GPU's bf16 peak."""

    mean_tokens: float = 2950.0  # per trajectory, prompt included
    mean_generated: float = 1375.0  # of which generated by the policy
    train_mfu: float = 0.4  # of peak, for the log-prob passes and the update (timing.TRAIN_MFU)
    shape: str = "grpo"  # timing.SHAPES: the rollouts' lengths (grpo: maxima at the budget)
    peak_tflops: float | None = None


@dataclass(frozen=True)
class ModelSizes:
    """What the plan reads of a model: its config.json sizes and exact parameter counts."""

    arch: ArchitectureConfig
    params: int
    largest_tensor: int  # elements of the largest parameter tensor (embedding, output layer)

    @property
    def q(self) -> int:
        return self.arch.num_attention_heads * self.arch.head_dim

    @property
    def k(self) -> int:
        return self.arch.num_key_value_heads * self.arch.head_dim


# model types whose parameters `count_parameters` adds up itself: (attention projection
# biases, per-head q/k RMSNorm); others are built by transformers on the meta device
DECODERS = {"qwen2": (True, False), "qwen3": (False, True), "llama": (False, False),
            "mistral": (False, False)}


@functools.cache
def count_parameters(arch: ArchitectureConfig) -> tuple[int, int]:
    """(parameters, elements of the largest tensor) of the model `arch` describes.

    For the decoders of DECODERS, by their layout (tests/test_plan.py checks it against
    transformers); otherwise the model is built by transformers on the meta device (no
    memory, but a few seconds of imports, which the DAG's start should not pay)."""
    if arch.model_type in DECODERS:
        bias, qk_norm = DECODERS[arch.model_type]
        h, i, V = arch.hidden_size, arch.intermediate_size, arch.vocab_size
        q = arch.num_attention_heads * arch.head_dim
        k = arch.num_key_value_heads * arch.head_dim
        layer = (2 * h * q + 2 * h * k  # q, o and k, v projections
                 + (q + 2 * k if bias else 0) + (2 * arch.head_dim if qk_norm else 0)
                 + 3 * h * i + 2 * h)  # MLP, two RMSNorms
        embed = V * h
        total = embed * (1 if arch.tie_word_embeddings else 2) + h \
            + arch.num_hidden_layers * layer
        return total, max(embed, h * i, h * q)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {f.name: getattr(arch, f.name) for f in dataclasses.fields(arch)
              if f.name != "model_type"}
    config = AutoConfig.for_model(arch.model_type, **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sizes = [p.numel() for p in model.parameters()]  # tied tensors once
    return sum(sizes), max(sizes)


def _arch_from_json(cfg: dict) -> ArchitectureConfig:
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return ArchitectureConfig(
        model_type=cfg["model_type"], hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"], tie_word_embeddings=cfg.get("tie_word_embeddings", False))


def model_sizes(backbone: BackboneConfig, toy=None) -> ModelSizes:
    """The backbone's sizes: its config.json where it is on disk (checked against the
    backbone file's `architecture` if both exist), else that `architecture`, else for a built
    (toy) backbone the `toy_backbone` section `toy` (its vocabulary as an upper bound)."""
    found = read_config_json(backbone)
    arch = _arch_from_json(found) if found is not None else backbone.architecture
    if found is not None and backbone.architecture is not None \
            and arch != backbone.architecture:
        diff = [f.name for f in dataclasses.fields(arch)
                if getattr(arch, f.name) != getattr(backbone.architecture, f.name)]
        raise ConfigError(f"backbone {backbone.id}: architecture differs from the config.json "
                          f"of {backbone.path} in {', '.join(diff)}")
    if arch is None and backbone.needs_build and toy is not None:
        arch = ArchitectureConfig(
            model_type="qwen3", hidden_size=toy.hidden_size,
            intermediate_size=toy.intermediate_size, num_hidden_layers=toy.num_hidden_layers,
            num_attention_heads=toy.num_attention_heads,
            num_key_value_heads=toy.num_key_value_heads, head_dim=toy.head_dim,
            vocab_size=-(-toy.vocab_size // 64) * 64, tie_word_embeddings=True)
    if arch is None:
        raise ConfigError(f"backbone {backbone.id}: no config.json at {backbone.path} (local "
                          "or in the hub cache) and no `architecture:` in its backbone file; "
                          "add one to plan memory")
    params, largest = count_parameters(arch)
    return ModelSizes(arch=arch, params=params, largest_tensor=largest)


# --------------------------------------------------------------------------------------------
# memory


@dataclass(frozen=True)
class Term:
    """One memory term of a phase, in bytes, with how it was computed."""

    name: str
    bytes: float
    how: str


@dataclass(frozen=True)
class Passes:
    """Token counts of the passes a cell's step runs (per rank)."""

    longest: int  # the longest trajectory in tokens (prompt + response budget)
    update_tokens: int  # padded tokens of one update micro-batch
    nograd_tokens: int  # of one old / reference micro-batch
    ig_tokens: int  # of one fused IG batch (0 without information gain)


def passes(cfg) -> Passes:
    """The passes' token counts: micro-batches are packed to `micro_batch_tokens` (a row longer
    than the budget goes alone) or hold `micro_batch_size` rows of the longest length."""
    # the engine's context: prompt + response (turns and observations) never exceed it
    longest = cfg.backbone.max_model_len
    sched = cfg.schedule
    micro = (max(sched.micro_batch_tokens, longest) if sched.micro_batch_tokens > 0
             else sched.micro_batch_size * longest)
    ig = cfg.ig_batch_size * longest if cfg.method.info_gain.enabled else 0
    return Passes(longest=longest, update_tokens=micro, nograd_tokens=micro, ig_tokens=ig)


def _dtype_bytes(cfg, on_gpu: bool) -> int:
    """Bytes per element of the policy's dtype (auto: bf16 on GPU, fp32 on CPU, as
    `backbone.resolve_dtype`)."""
    dtype = cfg.backbone.dtype
    if dtype == "auto":
        dtype = "bfloat16" if on_gpu else "float32"
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def _logprob_chunk(V: int, b: int, *, backward: bool, entropy: bool, chunk: int) -> float:
    """Bytes of one log-prob chunk at its peak (algo/logprobs.py). Forward: the logits, their
    fp32 copy (bf16 only) and the log-softmax. Backward (the chunk recomputed under
    checkpointing, its forward tensors gone): the log-softmax, its gradient and the logits'
    fp32 gradient, 12 B per element; an entropy adds its exp and that gradient (8 B)."""
    if backward:
        return chunk * V * (12 + (8 if entropy else 0))
    copy = 4 if b != 4 else 0  # .float() of bf16 logits; a no-op in fp32
    return chunk * V * (b + copy + 4 + (4 if entropy else 0))


def nograd_terms(sizes: ModelSizes, T: int, longest: int, b: int, label: str, *, cache: bool,
                 chunk: int | None = None) -> list[Term]:
    """A no-grad log-prob pass over T padded tokens in rows of at most `longest`: the final
    hidden states, then the larger of one layer's working set (with the attention mask the
    layer converts, rows x L^2) and a forward log-prob chunk (they do not overlap: the chunks
    run after the decoder), and with `cache` (the fused IG pass) the KV cache."""
    from a2tgpo.algo.logprobs import DEFAULT_CHUNK_TOKENS

    chunk = chunk or DEFAULT_CHUNK_TOKENS
    h, i, q, k = sizes.arch.hidden_size, sizes.arch.intermediate_size, sizes.q, sizes.k
    layer = T * (2 * h + 2 * q + 2 * k + 3 * i) * b + T * longest * b
    lp = _logprob_chunk(sizes.arch.vocab_size, b, backward=False, entropy=False, chunk=chunk)
    out = [Term(f"{label}: final hidden", T * h * b, f"{T} tokens x h x {b} B"),
           Term(f"{label}: layer or log-prob chunk", max(layer, lp),
                f"max(layer working set T x (2h + 2q + 2k + 3i + L) x {b} B = "
                f"{layer / GIB:.2f} GiB, {chunk}-token chunk x V = {lp / GIB:.2f} GiB)")]
    if cache:
        out.append(Term(f"{label}: KV cache", T * 2 * sizes.arch.num_hidden_layers * k * b,
                        f"{T} tokens x 2 x layers x k x {b} B"))
    return out


def update_terms(sizes: ModelSizes, T: int, longest: int, b: int, *, checkpointing: bool,
                 entropy: bool, chunk: int | None = None) -> list[Term]:
    """What one update micro-batch of T padded tokens (rows of at most `longest`) adds besides
    the weights' gradients: the saved activations (every layer's, or with checkpointing only
    the layer inputs), then at the peak of backward the larger of the log-prob chunk's
    backward with the output layer's gradient before accumulation and one layer's backward
    (recomputed under checkpointing), and the final hidden states with their gradient."""
    from a2tgpo.algo.logprobs import DEFAULT_CHUNK_TOKENS

    chunk = chunk or DEFAULT_CHUNK_TOKENS
    a = sizes.arch
    h, i, q, k, n_layers = a.hidden_size, a.intermediate_size, sizes.q, sizes.k, \
        a.num_hidden_layers
    act_layer = T * (4 * h + 7 * q + 2 * k + 4 * i) * b
    mask = T * longest * b  # the attention mask a layer converts and keeps: rows x L^2
    grads = T * (2 * i + 2 * h) * b  # a layer's activation gradients in flight
    lp = _logprob_chunk(a.vocab_size, b, backward=True, entropy=entropy, chunk=chunk) \
        + sizes.largest_tensor * b
    out = [Term("final hidden + gradient", T * h * (b + 4), f"{T} tokens x h x ({b} + 4) B")]
    if checkpointing:
        layer = act_layer + mask + grads
        out.append(Term("activations (checkpointed)", n_layers * T * h * b,
                        f"layer inputs: {n_layers} layers x {T} tokens x h x {b} B"))
    else:
        layer = grads
        out.append(Term("activations", n_layers * (act_layer + mask),
                        f"{n_layers} layers x {T} tokens x (4h + 7q + 2k + 4i + L) x {b} B"))
    out.append(Term("backward peak", max(layer, lp),
                    f"max(log-prob chunk backward + output layer gradient {lp / GIB:.2f} GiB, "
                    f"one layer's backward {layer / GIB:.2f} GiB)"))
    return out


def memory_phases(cfg, sizes: ModelSizes, *, world: int, on_gpu: bool, capacity: float,
                  index_bytes: float = 0.0, server_gpu: tuple[Term, ...] = ()
                  ) -> dict[str, list[Term]]:
    """Per-rank memory terms of each phase of a step of the cell `cfg` (a TrainConfig);
    `server_gpu`: what the job's retrieval server holds on each GPU, all job long."""
    P, k, n_layers = sizes.params, sizes.k, sizes.arch.num_hidden_layers
    b = _dtype_bytes(cfg, on_gpu)
    ds = cfg.backend == "deepspeed"
    W = world if ds else 1
    ps = passes(cfg)
    loss = cfg.method.loss
    entropy = loss.entropy_coef > 0 or loss.entropy_adv_alpha > 0

    resident = [Term("weights", P * b, f"{P / 1e9:.2f}B params x {b} B")]
    optimizer = optimizer_term(cfg, P, b, W)
    if ds:
        # a bucket never holds more than the model's gradients or weights
        resident.append(Term("ZeRO buckets", 2 * min(ZERO_BUCKET_ELEMENTS, P) * b,
                             "reduce + all-gather buckets, min(5e8, P) elements each"))
    if loss.kl_coef > 0:
        gathered = sizes.largest_tensor * b
        ref = {"copy": (P * b, "a full frozen copy"),
               "zero3": (P * b / W + gathered,
                         f"ZeRO-3: P x {b} B / {W} + the largest tensor gathered"),
               "zero3_offload": (gathered, "ZeRO-3, partitions in CPU: the largest tensor "
                                           + "gathered")}[cfg.reference]
        resident.append(Term(f"reference ({cfg.reference})", *ref))
    if on_gpu:
        resident.append(Term("CUDA context + allocator", CUDA_OVERHEAD_BYTES,
                             "estimate: two processes' contexts and fragmentation"))
        resident.extend(server_gpu)

    vllm = cfg.engine == "vllm"
    if vllm and on_gpu:
        awake = Term("vLLM engine (awake)", cfg.engine_memory_share * capacity,
                     f"engine_memory_share {cfg.engine_memory_share} of "
                     f"{capacity / GIB:.0f} GiB")
    elif vllm:
        kv = (cfg.engine_kv_cache_gb or VLLM_CPU_KV_BYTES / GIB) * GIB
        awake = Term("vLLM engine (CPU)", P * b + kv, "its own weights + KV cache")
    else:
        rows = cfg.schedule.prompts_per_step * cfg.method.rollout.n / W
        awake = Term("hf engine KV cache", rows * ps.longest * 2 * n_layers * k * b,
                     f"{rows:.0f} rows x {ps.longest} tokens x 2 x layers x k x {b} B")
    if vllm and cfg.engine_sleep and on_gpu:
        asleep = Term("vLLM engine (asleep)", ENGINE_ASLEEP_BYTES, "estimate: CUDA graphs, "
                                                                  "buffers")
    elif vllm:
        asleep = dataclasses.replace(awake, name=awake.name + " (never asleep)")
    else:
        asleep = Term("hf engine", 0.0, "generates with the policy itself")

    # the optimizer state on the device between updates, unless offloaded to the host
    between = [] if cfg.offload_optimizer else [optimizer]
    rollout = resident + between + [awake]
    if index_bytes:
        rollout.append(Term("retriever index", index_bytes, "in-process, on this device"))

    candidates = [nograd_terms(sizes, ps.nograd_tokens, ps.longest, b, "old/ref pass",
                               cache=False)]
    if ps.ig_tokens:
        candidates.append(nograd_terms(sizes, ps.ig_tokens, ps.longest, b, "IG pass",
                                       cache=True))
    passes_lp = max(candidates, key=lambda ts: sum(t.bytes for t in ts))
    logprob = resident + between + [asleep] + passes_lp + _reserve(passes_lp, on_gpu)

    grads = Term("gradients", (P * b / W if ds and cfg.zero_stage == 2 else P * b)
                 + (4 * P / W if ds else 0),
                 "ZeRO-2 partition" if ds and cfg.zero_stage == 2 else "full")
    passes_up = update_terms(sizes, ps.update_tokens, ps.longest, b,
                             checkpointing=cfg.gradient_checkpointing, entropy=entropy)
    update = resident + [optimizer, asleep, grads] + passes_up + _reserve(passes_up, on_gpu)
    return {"rollout": rollout, "logprob": logprob, "update": update}


def optimizer_term(cfg, P: int, b: int, W: int) -> Term:
    """The optimizer state of one rank: DeepSpeed ZeRO-1/2 keeps fp32 master weights and Adam
    moments for its 1/W of the parameters; one process, torch AdamW's moments."""
    if cfg.backend == "deepspeed":
        return Term("optimizer shard", 12 * P / W,
                    f"ZeRO-{cfg.zero_stage}: fp32 master + Adam m, v = 12 B x P / {W}")
    return Term("optimizer", 2 * P * b, f"AdamW m, v in the weights' dtype, 2 x {b} B")


def _reserve(passes_terms: list[Term], on_gpu: bool) -> list[Term]:
    """The caching allocator's reserve over a phase's passes (GPU only; RESERVED_SLACK)."""
    if not on_gpu:
        return []
    return [Term("allocator reserve", RESERVED_SLACK * sum(t.bytes for t in passes_terms),
                 f"estimate: {RESERVED_SLACK:.0%} of the passes' terms, released at the "
                 "phase's end")]


# --------------------------------------------------------------------------------------------
# the plan of a cell and of a study


@dataclass
class CellPlan:
    cell: str
    on_gpu: bool
    world: int
    capacity: float  # bytes per rank (GPU) or per job (CPU)
    phases: dict[str, list[Term]]
    tokens_per_step: float
    gpu_hours: float | None
    disk_bytes: float
    params: int
    steps: int = 0  # RL steps of the cell (0: ReAct, nothing trained)
    step_s: float | None = None  # estimated wall time of one step (GPU cells)
    gpu: object = None  # the timing.GpuSpec of the step time (GPU cells)
    host: list[Term] = dataclasses.field(default_factory=list)  # the job's host memory
    mem_request: float = math.inf  # bytes: the job's mem_mb (given, or derived from `host`)

    def total(self, phase: str) -> float:
        scale = 1 if self.on_gpu else self.world  # a CPU job's ranks share its memory
        return scale * sum(t.bytes for t in self.phases[phase])

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def peak(self) -> float:
        return self.total(self.peak_phase)

    @property
    def host_need(self) -> float:
        return sum(t.bytes for t in self.host)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity and self.host_need <= self.mem_request

    @property
    def largest(self) -> Term:
        return max(self.phases[self.peak_phase], key=lambda t: t.bytes)


def step_seconds(cfg, sizes: ModelSizes, world: int, assume: Assumptions, gpu,
                 cache: str | None = None) -> float:
    """Estimated wall time of one step on `world` GPUs of kind `gpu` (a timing.GpuSpec): the
    rollouts of the step and its share of validation, then the training passes
    (a2tgpo/timing.py, one model with bench/step_time.py). `cache`: _rollouts'."""
    from a2tgpo import timing

    b = _dtype_bytes(cfg, True)
    model = timing.ModelCost.of(sizes.arch, sizes.params, b)
    sched, n = cfg.schedule, cfg.method.rollout.n
    # AEPO branches after each wave under either schedule (a2tgpo/rollout/trees.py)
    agent = (dataclasses.replace(cfg.rollout, schedule="waves")
             if cfg.method.rollout.shape == "aepo" else cfg.rollout)
    rollout = _rollouts(gpu, model, assume.shape, sched.prompts_per_step, n, world, agent,
                        cfg.engine_memory_share, cache)
    val = sched.eval_questions or sched.prompts_per_step
    validation = _rollouts(gpu, model, assume.shape, val, 1, world, cfg.rollout,
                           cfg.engine_memory_share, cache)
    passes = timing.training_seconds(
        model, rollout.lengths, rollout.prefixes, gpu=gpu, gpus=world, mfu=assume.train_mfu,
        ppo_epochs=sched.ppo_epochs, reference=cfg.method.loss.kl_coef > 0,
        ig="fused" if cfg.method.info_gain.enabled else None,
        checkpointing=cfg.gradient_checkpointing)
    return (rollout.seconds + validation.seconds / max(1, sched.eval_every)
            + sum(passes.values()) + timing.OTHER_S)


@functools.cache
def _rollouts(gpu, model, shape: str, prompts: int, n: int, ranks: int, agent_cfg,
              memory_share: float, cache: str | None = None):
    """timing.simulate_step, kept in `cache` (a folder; None: this process only) under a
    digest of its inputs and of the package's code: the simulations cost seconds, and every
    Snakemake start plans the study."""
    from a2tgpo import timing

    def run():
        return timing.simulate_step(gpu, model, timing.SHAPES[shape], prompts=prompts, n=n,
                                    ranks=ranks, agent_cfg=agent_cfg,
                                    schedule=agent_cfg.schedule, memory_share=memory_share)

    if cache is None:
        return run()
    key = hashlib.sha256(json.dumps(
        [dataclasses.asdict(gpu), dataclasses.asdict(model), shape,
         dataclasses.asdict(timing.SHAPES[shape]), prompts, n, ranks,
         dataclasses.asdict(agent_cfg), memory_share, _code_digest()],
        sort_keys=True, default=str).encode()).hexdigest()[:32]
    path = Path(cache) / f"{key}.json"
    try:
        rows = json.loads(path.read_text())
        return timing.StepRollouts(tuple(
            timing.RolloutTiming(**{**r, "lengths": tuple(r["lengths"]),
                                    "responses": tuple(r["responses"]),
                                    "prefixes": tuple(map(tuple, r["prefixes"]))})
            for r in rows))
    except (OSError, ValueError, TypeError, KeyError):
        pass  # absent or damaged: simulate and (re)write it
    out = run()
    try:
        atomic_write_json(path, [dataclasses.asdict(r) for r in out.ranks])
    except OSError as e:  # a read-only cache slows the next start, nothing more
        log.warning("step-time cache %s not written: %s", path, e)
    return out


@functools.cache
def _code_digest() -> str:
    """The digest of every module of the package: a cached simulation is one this code made."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def study_gpu(study, assume: Assumptions):
    """The timing.GpuSpec of the study's `train.gpu_model`, with `train.gpu_spec`'s numbers and
    the assumed peak, where given."""
    from a2tgpo import timing

    spec = dict(study.train.gpu_spec)
    if assume.peak_tflops is not None:
        spec["bf16_tflops"] = assume.peak_tflops
    return timing.gpu_spec(study.train.gpu_model, **spec)


def disk_bytes(cfg, sizes: ModelSizes, on_gpu: bool) -> float:
    """Checkpoint disk of a cell: HF weights in every kept checkpoint (keep_last and the
    selected one), optimizer state in the newest schedule.optimizer_states (rl.py,
    checkpoint.py)."""
    b = _dtype_bytes(cfg, on_gpu)
    weights = sizes.params * b
    if not cfg.method.train:
        return weights  # the starting policy's step-0 checkpoint
    kept = cfg.schedule.keep_last + 1
    state = (12 * sizes.params + weights) if cfg.backend == "deepspeed" else 2 * weights
    return kept * weights + min(cfg.schedule.optimizer_states, kept) * state


@dataclass(frozen=True)
class ServerMemory:
    """What a job's own retrieval server (retrieval.http.serve: job) holds."""

    gpu: tuple[Term, ...]  # on each GPU of the job
    host: tuple[Term, ...]  # in the job's host memory


def index_size(study) -> tuple[float, str]:
    """(bytes, how known) of the dense index file: its size on disk, else the download's
    expected_bytes, else corpus rows x the encoder's width x 4 B (a Flat index's vectors);
    (0, why) when none is known yet."""
    path = Path(index_file(study))
    if path.is_file():
        return float(path.stat().st_size), f"{path} on disk"
    dl = study.corpus.download
    if study.corpus.source == "hub" and dl.index.enabled and dl.index.expected_bytes:
        return float(dl.index.expected_bytes), "corpus.download.index.expected_bytes"
    rows = dl.expected_lines if study.corpus.source == "hub" else None
    width, source = study.retrieval.index.dim, "retrieval.index.dim"
    for folder in (study.retrieval.encoder.model, encoder_dir(study)):
        config = Path(folder) / "config.json"
        if width is None and config.is_file():
            width, source = json.loads(config.read_text())["hidden_size"], str(config)
    if rows and width and study.retrieval.index.factory == "Flat":
        return float(rows * width * 4), f"{rows:,} rows x {width} ({source}) x 4 B"
    return 0.0, "index not on disk yet: not counted (rerun `a2tgpo plan` once it is)"


def server_memory(study, *, gpus: int, on_gpu: bool) -> ServerMemory:
    """The job's own retrieval server: faiss reads the whole index into host memory (kept
    there on CPU); on a GPU job with retrieval.index.gpu on or auto it is then sharded over the
    job's `gpus` GPUs, a Flat index's vectors in fp16 (retrieval/index.py load_index)."""
    r = study.retrieval
    if r.mode != "http" or r.http.serve != "job" or r.retriever != "dense":
        return ServerMemory((), ())
    size, how = index_size(study)
    host = (Term("retrieval server: index", size, how),
            Term("retrieval server: process", PROCESS_HOST_BYTES[on_gpu], "estimate"))
    if not (on_gpu and gpus > 0 and r.index.gpu != "off"):
        return ServerMemory((), host)
    half = 2 if r.index.factory == "Flat" else 1
    gpu = (Term("retrieval server: index shard", size / half / gpus,
                f"{how}{' / 2 (fp16)' if half == 2 else ''} / {gpus} GPUs"),
           Term("retrieval server: faiss scratch + context", FAISS_GPU_EXTRA_BYTES,
                "estimate: faiss-gpu temporary memory, a CUDA context"))
    return ServerMemory(gpu, host)


def mem_request(mem_mb: int | None, need: float) -> float:
    """A job's memory request in bytes: mem_mb as given, or (null) the planned host memory
    `need` x HOST_HEADROOM, rounded up to whole MB."""
    if mem_mb is not None:
        return mem_mb * MIB
    return math.ceil(need * HOST_HEADROOM / MIB) * MIB


def train_host_terms(cfg, sizes: ModelSizes, phases_peak: float, *, on_gpu: bool,
                     ranks: int, nodes: int, server: ServerMemory) -> list[Term]:
    """Host memory of one node of a training job with `ranks` ranks (all of a CPU job's
    device plan, `phases_peak`, is host memory)."""
    b = _dtype_bytes(cfg, on_gpu)
    vllm = cfg.engine == "vllm"
    procs = ranks * (2 if vllm else 1)
    terms = [Term("processes", procs * PROCESS_HOST_BYTES[on_gpu],
                  f"estimate: {procs} processes (a trainer{' and a vLLM engine' if vllm else ''}"
                  f" per rank) x {PROCESS_HOST_BYTES[on_gpu] / GIB:.0f} GiB")]
    if not on_gpu:
        terms.append(Term("ranks' tensors", phases_peak, "the peak phase of the device plan"))
    else:
        bytes_sync = vllm and cfg.weight_sync == "bytes"
        terms.append(Term("policy weights", ranks * sizes.params * b,
                          f"{ranks} ranks x P x {b} B: loaded here"
                          + (", later the asleep engine's offloaded copy (sleep level 1)"
                             if bytes_sync else "")))
        if bytes_sync:
            terms.append(Term(
                "weight sync in transit", ranks * sizes.params * b * BYTES_SYNC_HOST_COPIES,
                f"train.weight_sync bytes: {ranks} ranks x P x {b} B x "
                f"{BYTES_SYNC_HOST_COPIES:.2f} host copies each step (ipc: none)"))
        if cfg.offload_optimizer:
            opt = optimizer_term(cfg, sizes.params, b, ranks * nodes)
            terms.append(Term("offloaded optimizer state", ranks * opt.bytes,
                              f"train.offload_optimizer, pinned: {ranks} ranks x {opt.how}"))
        terms.append(Term("checkpoint save", min(SAVE_SHARD_BYTES, sizes.params * b),
                          "rank 0: one weights shard at a time (checkpoint.save_weights)"))
        if cfg.method.loss.kl_coef > 0 and cfg.reference == "zero3_offload":
            terms.append(Term("reference partitions", sizes.params * b / nodes,
                              f"ZeRO-3 offload: P x {b} B / {nodes} nodes"))
    return terms + list(server.host)


def plan_cell(cfg, sizes: ModelSizes, *, on_gpu: bool, world: int, capacity: float | None,
              assume: Assumptions = Assumptions(), index_bytes: float = 0.0,
              server: ServerMemory = ServerMemory((), ()), ranks: int | None = None,
              nodes: int = 1, mem_mb: int | None = None, gpu=None,
              cache: str | None = None) -> CellPlan:
    """`capacity`: per GPU (GPU cells); None on CPU cells: the job's memory request, mem_mb
    or derived from the plan. `gpu`: the timing.GpuSpec of the step time (default: H100);
    `cache`: where its simulations are kept (_rollouts)."""
    phases = memory_phases(cfg, sizes, world=world, on_gpu=on_gpu, capacity=capacity or 0.0,
                           index_bytes=index_bytes, server_gpu=server.gpu)
    sched = cfg.schedule
    steps = sched.steps if cfg.method.train else 0
    if on_gpu and gpu is None:
        from a2tgpo.timing import GPUS

        gpu = GPUS["h100"]
    step_s = step_seconds(cfg, sizes, world, assume, gpu, cache) if on_gpu else None
    hours = steps * step_s * world / 3600 if step_s is not None else None
    plan = CellPlan(cell=cfg.cell, on_gpu=on_gpu, world=world, capacity=capacity or 0.0,
                    phases=phases,
                    tokens_per_step=sched.prompts_per_step * cfg.method.rollout.n
                    * assume.mean_tokens,
                    gpu_hours=hours, disk_bytes=disk_bytes(cfg, sizes, on_gpu),
                    params=sizes.params, steps=steps, step_s=step_s,
                    gpu=gpu if step_s is not None else None)
    plan.host = train_host_terms(cfg, sizes, plan.peak, on_gpu=on_gpu,
                                 ranks=world if ranks is None else ranks, nodes=nodes,
                                 server=server)
    plan.mem_request = mem_request(mem_mb, plan.host_need)
    if not on_gpu:
        plan.capacity = plan.mem_request
    return plan


def _index_bytes(study, on_gpu: bool) -> float:
    """An in-process dense index on the training device: its file's size (0 if not built yet,
    or when a retrieval server holds it)."""
    r = study.retrieval
    if r.mode != "inprocess" or r.retriever != "dense" or (on_gpu and r.index.gpu == "off"):
        return 0.0
    path = Path(index_file(study))
    return float(path.stat().st_size) if path.is_file() else 0.0


def index_note(study) -> str:
    """Where the retrieval index sits, and its size when it is known."""
    r = study.retrieval
    if r.retriever != "dense":
        return f"retrieval: {r.retriever} in the rollout process (no dense index)"
    path = Path(index_file(study))
    size, how = index_size(study)
    size = f"{size / GIB:.1f} GiB, {how}" if size else how
    if r.mode == "http" and r.http.serve == "job":
        return (f"retrieval index {path} ({size}): on each job's own retrieval server "
                f"(retrieval.http.serve job), in the job's host memory"
                + ("" if r.index.gpu == "off" else
                   f" while loading, then sharded over the job's GPUs (index.gpu {r.index.gpu})")
                + "; counted in the job's plan")
    if r.mode == "http":
        return (f"retrieval index {path} ({size}): on the retrieval server (retrieval.mode "
                "http), not on the training GPUs")
    return (f"retrieval index {path} ({size}): in every rollout process, on the GPU when "
            f"retrieval.index.gpu allows ({r.index.gpu}); counted in the rollout phase")


def _on_gpu(study, backbone_id: str) -> bool:
    return study.train.device != "cpu" and not study.backbone(backbone_id).needs_build


def plan_study(study, sets: list[str] | None = None, assume: Assumptions = Assumptions()
               ) -> list[CellPlan]:
    """The plan of every cell of the study's grid sets (all sets by default), in set order.
    The step-time simulations are kept in the study's cache folder (StudyConfig.cache_dir)."""
    by_set = study_cells(study)
    cells = list(dict.fromkeys(c for name, cs in by_set.items()
                               if sets is None or name in sets for c in cs))
    train = study.train
    sizes: dict[str, ModelSizes] = {}
    plans = []
    for cell in cells:
        cfg = resolve_cell(study, cell.path)
        on_gpu = _on_gpu(study, cell.backbone)
        if cell.backbone not in sizes:
            sizes[cell.backbone] = model_sizes(cfg.backbone, study.toy_backbone)
        ds = cfg.backend == "deepspeed"
        world = train.nproc * train.nodes if ds else 1
        ranks = train.nproc if ds else 1  # per node: what one node's memory holds
        plans.append(plan_cell(
            cfg, sizes[cell.backbone], on_gpu=on_gpu, world=world,
            capacity=train.gpu_memory_gb * GIB if on_gpu else None, assume=assume,
            index_bytes=_index_bytes(study, on_gpu),
            server=server_memory(study, gpus=train.nproc, on_gpu=on_gpu), ranks=ranks,
            nodes=train.nodes if ds else 1, mem_mb=train.mem_mb,
            gpu=study_gpu(study, assume) if on_gpu else None,
            cache=str(study_cache(study) / "a2tgpo" / "step_time")))
    return plans


@dataclass
class EvalPlan:
    """An evaluation job of one backbone's cells: one engine on `gpus` GPUs (or the CPU) and
    the job's retrieval server."""

    backbone: str
    on_gpu: bool
    gpus: int
    capacity: float  # bytes per GPU (0 on CPU)
    gpu: list[Term]  # on each GPU
    host: list[Term]
    mem_request: float

    @property
    def gpu_need(self) -> float:
        return sum(t.bytes for t in self.gpu)

    @property
    def host_need(self) -> float:
        return sum(t.bytes for t in self.host)

    @property
    def fits(self) -> bool:
        return self.gpu_need <= self.capacity and self.host_need <= self.mem_request


def plan_evals(study, sets: list[str] | None = None) -> list[EvalPlan]:
    """The evaluation job of each backbone of the grid sets (all by default): on GPU the
    engine's share of each GPU (eval.engine_memory_share; hf: the weights and the KV cache of
    a batch) and the server's shard; in host memory the processes, the policy weights (and
    on CPU the engine), and the server."""
    ev, train = study.eval, study.train
    first = {}
    for name, cs in study_cells(study).items():
        for c in cs:
            if sets is None or name in sets:
                first.setdefault(c.backbone, c)
    out = []
    for backbone, cell in first.items():
        cfg = resolve_cell(study, cell.path)
        sizes = model_sizes(cfg.backbone, study.toy_backbone)
        on_gpu = _on_gpu(study, backbone) and ev.gpus > 0
        b = _dtype_bytes(cfg, on_gpu)
        P, a = sizes.params, sizes.arch
        weights = Term("policy weights", P * b, f"P x {b} B")
        vllm = cfg.engine == "vllm"
        server = server_memory(study, gpus=ev.gpus if on_gpu else 0, on_gpu=on_gpu)
        capacity = train.gpu_memory_gb * GIB if on_gpu else 0.0
        rows = ev.max_batch or 32
        kv = Term("hf engine KV cache",
                  rows * cfg.backbone.max_model_len * 2 * a.num_hidden_layers * sizes.k * b,
                  f"{rows} rows x {cfg.backbone.max_model_len} tokens x 2 x layers x k x {b} B")
        if vllm and on_gpu:
            engine = [Term("vLLM engine", ev.engine_memory_share * capacity,
                           f"eval.engine_memory_share {ev.engine_memory_share} of "
                           f"{capacity / GIB:.0f} GiB (weights, KV cache)")]
        elif vllm:
            cache = (cfg.engine_kv_cache_gb or VLLM_CPU_KV_BYTES / GIB) * GIB
            engine = [weights, Term("vLLM engine KV cache (CPU)", cache, "engine_kv_cache_gb")]
        else:
            engine = [weights, kv]
        gpu = (engine + [Term("CUDA context", CUDA_OVERHEAD_BYTES / 2, "estimate")]
               + list(server.gpu)) if on_gpu else []
        procs = 2 if vllm else 1
        host = [Term("processes", procs * PROCESS_HOST_BYTES[on_gpu],
                     f"estimate: {procs} x {PROCESS_HOST_BYTES[on_gpu] / GIB:.0f} GiB")]
        host += [weights] if on_gpu else engine
        host += list(server.host)
        need = sum(t.bytes for t in host)
        out.append(EvalPlan(backbone, on_gpu, ev.gpus if on_gpu else 0, capacity, gpu, host,
                            mem_request(ev.mem_mb, need)))
    return out


def _host_line(what: str, need: float, request: float, terms: list[Term], key: str) -> str:
    t = max(terms, key=lambda t: t.bytes)
    return (f"  {what}: needs {need / GIB:.1f} GiB of host memory, {key} requests "
            f"{request / GIB:.1f}; largest term: {t.name} {t.bytes / GIB:.1f} GiB ({t.how}); "
            f"raise {key} or set it to null (derived from the plan)")


def refusal(plans: list[CellPlan], evals: list[EvalPlan] = ()) -> str | None:
    """The error naming every cell (and evaluation job) that does not fit and its largest
    term; None if all fit."""
    bad = [p for p in plans if not p.fits]
    bad_evals = [e for e in evals if not e.fits]
    if not bad and not bad_evals:
        return None
    lines = []
    if bad:
        lines.append(f"{len(bad)} of {len(plans)} cells do not fit (see `a2tgpo plan CONFIG`):")
    for p in bad[:REFUSAL_LINES]:
        if p.peak > p.capacity:
            t = p.largest
            where = "per GPU (train.gpu_memory_gb)" if p.on_gpu else "per job (train.mem_mb)"
            lines.append(f"  cell {p.cell}: the {p.peak_phase} phase needs "
                         f"{p.peak / GIB:.1f} GiB {where} of {p.capacity / GIB:.1f}; largest "
                         f"term: {t.name} {t.bytes / GIB:.1f} GiB ({t.how})")
        else:
            lines.append(_host_line(f"cell {p.cell}", p.host_need, p.mem_request, p.host,
                                    "train.mem_mb"))
    if len(bad) > REFUSAL_LINES:
        lines.append(f"  ... and {len(bad) - REFUSAL_LINES} more")
    for e in bad_evals:
        what = f"evaluation jobs of backbone {e.backbone}"
        if e.gpu_need > e.capacity:
            t = max(e.gpu, key=lambda t: t.bytes)
            lines.append(f"  {what}: need {e.gpu_need / GIB:.1f} GiB per GPU "
                         f"(train.gpu_memory_gb {e.capacity / GIB:.1f}); largest term: "
                         f"{t.name} {t.bytes / GIB:.1f} GiB ({t.how}); lower "
                         "eval.engine_memory_share or give eval.gpus more GPUs")
        else:
            lines.append(_host_line(what, e.host_need, e.mem_request, e.host, "eval.mem_mb"))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# printing


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _terms_table(title: str, terms: list[Term], limit: float, limit_name: str,
                 caption: str = ""):
    from rich.table import Table

    table = Table(title=title, caption=caption or None)
    table.add_column("term")
    table.add_column("GiB", justify="right")
    table.add_column("how")
    for t in terms:
        table.add_row(t.name, _gib(t.bytes), t.how)
    table.add_row("[b]total[/b]", f"[b]{_gib(sum(t.bytes for t in terms))}[/b]", "")
    table.add_row("limit", _gib(limit), limit_name)
    return table


def _host_table(title: str, terms: list[Term], request: float, caption: str = ""):
    return _terms_table(title, terms, request,
                        f"the job's mem_mb request (null: the total x {HOST_HEADROOM:g})",
                        caption)


def print_plan(plans: list[CellPlan], assume: Assumptions, console=None,
               evals: list[EvalPlan] = ()) -> None:
    """Per distinct memory plan, the terms of each phase and of the job's host memory; then one
    line per cell; the evaluation jobs; then the totals and the assumptions."""
    import sys

    from rich.console import Console
    from rich.table import Table

    # a log file gets wide lines rather than folded tables
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    seen: dict[tuple, list[str]] = {}
    for p in plans:
        key = tuple((ph, tuple((t.name, round(t.bytes)) for t in ts))
                    for ph, ts in p.phases.items())
        seen.setdefault(key, []).append(p.cell)
    for cells in seen.values():
        p = next(pl for pl in plans if pl.cell == cells[0])
        unit = "per rank" if p.on_gpu else f"per rank (x{p.world} ranks per job)"
        table = Table(title=f"{cells[0]}" + (f" and {len(cells) - 1} more cells with the same "
                                             "plan" if len(cells) > 1 else ""),
                      caption=f"GiB {unit}; capacity {_gib(p.capacity)} GiB")
        table.add_column("phase")
        table.add_column("term")
        table.add_column("GiB", justify="right")
        table.add_column("how")
        for phase, terms in p.phases.items():
            for t in terms:
                table.add_row(phase, t.name, _gib(t.bytes), t.how)
            table.add_row(phase, "[b]total[/b]", f"[b]{_gib(p.total(phase))}[/b]", "",
                          end_section=True)
        console.print(table)
        console.print(_host_table(f"{cells[0]}: host memory of a job's node", p.host,
                                  p.mem_request))
    table = Table(title="cells")
    for col in ("cell", "params", "peak phase", "peak GiB", "capacity GiB", "largest term",
                "fits", "tokens/step", "s/step", "GPU-hours", "disk GiB"):
        table.add_column(col, justify="left" if col in ("cell", "largest term") else "right",
                         overflow="fold")
    for p in plans:
        table.add_row(p.cell, f"{p.params / 1e9:.2f}B", p.peak_phase, _gib(p.peak),
                      _gib(p.capacity), f"{p.largest.name} {_gib(p.largest.bytes)}",
                      "yes" if p.fits else "[red]NO[/red]", f"{p.tokens_per_step:,.0f}",
                      "-" if p.step_s is None else f"{p.step_s:,.0f}",
                      "-" if p.gpu_hours is None else f"{p.gpu_hours:,.0f}",
                      _gib(p.disk_bytes))
    console.print(table)
    for e in evals:
        where = f"{e.gpus} GPU(s)" if e.on_gpu else "CPU"
        if e.on_gpu:
            console.print(_terms_table(f"evaluation jobs of {e.backbone}: per GPU", e.gpu,
                                       e.capacity, "train.gpu_memory_gb"))
        console.print(_host_table(f"evaluation jobs of {e.backbone} ({where}): host memory",
                                  e.host, e.mem_request,
                                  "fits" if e.fits else "[red]does NOT fit[/red]"))
    fit = sum(p.fits for p in plans)
    hours = [p.gpu_hours for p in plans if p.gpu_hours is not None]
    console.print(f"{fit} of {len(plans)} cells fit; checkpoint disk for the grid "
                  f"{sum(p.disk_bytes for p in plans) / GIB:,.0f} GiB"
                  + (f"; {sum(hours):,.0f} GPU-hours on "
                     f"{', '.join(sorted({p.gpu.name for p in plans if p.gpu}))} (estimate)"
                     if hours else ""))
    for g in dict.fromkeys(p.gpu for p in plans if p.gpu):
        console.print(f"step time on {g.name}: {g.hbm_bytes_per_s / 1e12:g} TB/s, "
                      f"{g.bf16_flops / 1e12:g} TFLOP/s bf16, {g.step_overhead_s * 1e3:g} ms per "
                      f"engine step ({g.source or 'train.gpu_spec'})")
    console.print("assumptions: " + ", ".join(
        f"{f.name}={v:g}" if isinstance(v, float) else f"{f.name}={v}"
        for f in dataclasses.fields(assume) if (v := getattr(assume, f.name)) is not None)
        + "; step time: a2tgpo/timing.py (bench/step_time.py checks it against A2TGPO Fig. 7)")


# --------------------------------------------------------------------------------------------
# retries: enough training jobs for a cell's whole run at the partition's time limit

# set-up of a training job before its first step (model load, engines, the job's retrieval
# server loading its index): an assumption, stated in what the DAG prints
JOB_SETUP_S = 600.0


@dataclass(frozen=True)
class RetryPlan:
    retries: int | None  # the train rule's; None: the profile's `retries`
    lines: tuple[str, ...]  # what the DAG prints
    error: str | None = None  # a step longer than a whole job: no number of retries helps


def measured_step_s(run_dir: str | Path) -> tuple[float | None, int]:
    """(mean `time/step` of the cell's logged steps, the last logged step); (None, 0) before
    any step ran."""
    from a2tgpo.tracking import read_metrics

    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return None, 0
    rows = read_metrics(run_dir)
    times = [r["time/step"] for r in rows if "time/step" in r]
    last = max((r["step"] for r in rows), default=0)
    return (sum(times) / len(times) if times else None), last


def plan_retries(study, plans: list[CellPlan], run_dirs: dict[str, str]) -> RetryPlan:
    """Retries of the train rule from the longest cell: its remaining steps x seconds per step
    (measured from the cell's metrics.jsonl, else train.seconds_per_step, else the plan's GPU
    estimate) over what one job can do (train.runtime_min minus train.stop_margin_s and
    JOB_SETUP_S), plus train.spare_retries for preemptions and failures."""
    train = study.train
    usable = train.runtime_min * 60 - train.stop_margin_s - JOB_SETUP_S
    worst, unknown, lines = None, [], []
    for p in plans:
        if p.steps == 0:
            continue
        step_s, done = measured_step_s(run_dirs[p.cell])
        source = "measured"
        if step_s is None and train.seconds_per_step is not None:
            step_s, source = train.seconds_per_step, "train.seconds_per_step"
        if step_s is None and p.step_s is not None:
            step_s, source = p.step_s, "estimated (`a2tgpo plan`)"
        if step_s is None:
            unknown.append(p.cell)
            continue
        if usable < step_s:
            return RetryPlan(None, (), (
                f"cell {p.cell}: one step takes {step_s:,.0f} s ({source}) but a training job "
                f"has {usable:,.0f} s (train.runtime_min {train.runtime_min} x 60 - "
                f"stop_margin_s {train.stop_margin_s:.0f} - {JOB_SETUP_S:.0f} s set-up): no "
                "job can finish a step; raise train.runtime_min or shrink the step"))
        jobs = max(1, math.ceil(max(0, p.steps - done) * step_s / usable))
        if worst is None or (jobs, p.steps * step_s) > (worst[0], worst[4] * worst[2]):
            worst = (jobs, p.cell, step_s, source, p.steps - done)
    if worst is None:
        if unknown and any(p.on_gpu for p in plans):
            lines.append("train retries: the profile's; no seconds per step known for "
                         f"{len(unknown)} cells (set train.seconds_per_step)")
        return RetryPlan(None, tuple(lines))
    jobs, cell, step_s, source, steps = worst
    retries = jobs - 1 + train.spare_retries
    lines.append(
        f"train retries: {retries} = {jobs} jobs for the longest cell ({cell}: {steps} steps x "
        f"{step_s:,.0f} s/step, {source}, at {usable / 3600:,.1f} h of work per "
        f"{train.runtime_min}-min job) - 1 + {train.spare_retries} spare (train.spare_retries)")
    if jobs > 1 and train.spare_retries == 0:
        lines.append("warning: train.spare_retries is 0: one preemption or failure and a "
                     "cell's retries run out before its last step")
    if unknown:
        lines.append(f"warning: no seconds per step known for {len(unknown)} cells; they get "
                     "the same retries")
    return RetryPlan(retries, tuple(lines))
