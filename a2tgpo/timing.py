"""A step-time model: a roofline of a named GPU, a continuous-batching engine on a virtual clock
that the real agent loop drives, and the log-prob, IG and update stages from FLOPs.

One definition for `a2tgpo plan` (GPU-hours, the train rule's retries) and bench/step_time.py
(s/step per stage, waves against per-trajectory, checked against A2TGPO's Fig. 7).

Decode and prefill. One engine step runs every sequence in flight (one token each) plus the
prefill chunks that fit `MAX_BATCHED_TOKENS` (vLLM's chunked prefill), and takes

    max(bytes / (HBM bandwidth x MEM_EFFICIENCY), FLOPs / (bf16 peak x COMPUTE_EFFICIENCY))
        + the GPU's per-step overhead,

bytes = the weights (P x 2 B) + the KV cache read (tokens in flight x 2 x layers x k x 2 B),
FLOPs = 2P per token computed + attention 4 x layers x q per (token, context token). A
sequence's turn ends after its sampled length; it leaves the batch at that step and a waiting
request takes its place (continuous batching). The KV cache holds `kv_capacity_tokens`: a
request is admitted only when its context fits, and the newest sequence is preempted and later
recomputed (vLLM's recompute preemption) when growing contexts overflow it. Prefix caching is
assumed to hold: a turn prefills only the tokens its engine has not seen (the observation; the
question once per group).

The simulated policy (`SimEngine`) answers token-in/token-out like the hf and vLLM engines, so
`a2tgpo.rollout.agent` runs unchanged on it; what it samples is drawn from stated distributions
(`TrajectoryShape`) with the agent's per-(trajectory, turn) seed, so both schedules produce the
same trajectories and differ only in time. Searches cost `SEARCH_BASE_S + SEARCH_PER_QUERY_S x
queries` of virtual time per retriever call, during which the engine goes on with what it holds
(as vLLM V1's engine core does in its own process; an engine stepped only from the agent's
thread would idle there). `simulate_lockstep` runs the papers' stack instead: verl's waves over
all GPUs at once, no prefix cache between turns.

Training stages (FLOPs at `train_mfu` of the bf16 peak over all GPUs): a forward over a row of
L tokens costs 2P·L + 2·layers·q·L² (causal attention); the old log-prob pass and the reference
pass one forward each; the update 4 forwards per epoch with gradient checkpointing (forward,
recompute, backward = 2), 3 without, over packed micro-batches (`PACKING`); the information-gain
pass either fused with the old log-prob pass (ours: one forward over trajectory + probes) or one
forward per (trajectory, turn) prefix (`ig="per_prefix"`, IGPO's released "single-pass" code,
which A2TGPO's Fig. 7 times).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

GIB = 2**30

# estimate: the share of the HBM's nominal bandwidth a decode step's reads reach (vLLM's paged
# attention and the weight GEMVs stream at ~75-90% of nominal; STREAM-like copies ~90%)
MEM_EFFICIENCY = 0.8
# estimate: the share of the bf16 peak a compute-bound engine step reaches (large-batch decode
# GEMMs and prefill chunks)
COMPUTE_EFFICIENCY = 0.7
# vLLM's scheduler token budget per step (max_num_batched_tokens, V1's default on most GPUs)
MAX_BATCHED_TOKENS = 8192
MAX_NUM_SEQS = 256  # vLLM's max_num_seqs default
# estimate: what the engine keeps beside weights and KV cache within its memory share
# (activations of a step, CUDA graphs, sampler buffers)
ENGINE_RESERVE_BYTES = 2.0 * GIB
# assumption: one retriever call (HTTP, e5 encode, faiss Flat on GPU, document lookup): a
# base latency plus a share per query (the gpu-path spec's estimate: 0.2-0.5 s for a wave of
# 128 queries per rank)
SEARCH_BASE_S = 0.05
SEARCH_PER_QUERY_S = 0.002
# estimate: per step, what is neither rollout nor a pass: the weight sync to the engine, the
# ranks' gathers, scoring, metrics, amortised checkpoints (gpu-path spec: 20-40 s on the host
# path, a few seconds in-process)
OTHER_S = 10.0
# estimate: the training passes' model-FLOPs utilisation (gpu-path spec: verl 0.46-0.65 with
# flash-attn varlen; HF modules with sdpa and masks lower)
TRAIN_MFU = 0.4
# the update's micro-batches packed to a token budget: computed / real tokens on the papers'
# length spread (bench/padding.py: 1.08 at 16k tokens)
PACKING = 1.08


@dataclass(frozen=True)
class GpuSpec:
    """What the roofline needs of one GPU; numbers from the vendor's datasheet (`source`)."""

    name: str
    hbm_bytes_per_s: float  # nominal HBM bandwidth
    bf16_flops: float  # dense bf16 tensor-core peak (no sparsity)
    memory_gib: float
    # estimate: per engine step, what is not GPU math (scheduling, sampling, launch gaps
    # between CUDA graphs), ~3-5 ms in vLLM V1 at 100+ sequences
    step_overhead_s: float = 4e-3
    source: str = ""


GPUS: dict[str, GpuSpec] = {
    # not on nvidia.com; the figures every report of the part gives (e.g. SemiAnalysis,
    # "Nvidia's new China AI chips", Nov 2023): 96 GB HBM3 at 4.0 TB/s, 148 TFLOPS FP16/BF16
    "h20": GpuSpec("H20", 4.0e12, 148e12, 96, source="96 GB HBM3, 4.0 TB/s, 148 TF bf16 dense "
                   "(SemiAnalysis, Nov 2023)"),
    "h100": GpuSpec("H100 SXM", 3.35e12, 989e12, 80, source="NVIDIA H100 datasheet: SXM5 80 GB "
                    "HBM3 3.35 TB/s, bf16 1,979 TF with sparsity = 989 dense"),
    "h200": GpuSpec("H200 SXM", 4.8e12, 989e12, 141, source="NVIDIA H200 datasheet: 141 GB "
                    "HBM3e 4.8 TB/s, bf16 1,979 TF with sparsity = 989 dense"),
    "a100": GpuSpec("A100 SXM 80GB", 2.039e12, 312e12, 80, source="NVIDIA A100 datasheet: 80 GB "
                    "HBM2e 2,039 GB/s, bf16 312 TF dense"),
}


def gpu_spec(name: str, hbm_tb_s: float | None = None, bf16_tflops: float | None = None,
             step_overhead_ms: float | None = None, memory_gib: float | None = None) -> GpuSpec:
    """The named GPU of GPUS, with any of its numbers replaced (an explicit spec)."""
    if name not in GPUS:
        raise ValueError(f"unknown GPU {name!r}: one of {', '.join(GPUS)}")
    spec = GPUS[name]
    changes = {k: v for k, v in (("hbm_bytes_per_s", hbm_tb_s and hbm_tb_s * 1e12),
                                 ("bf16_flops", bf16_tflops and bf16_tflops * 1e12),
                                 ("step_overhead_s", step_overhead_ms and step_overhead_ms / 1e3),
                                 ("memory_gib", memory_gib)) if v}
    if not changes:
        return spec
    return dataclasses.replace(spec, **changes, source=f"{spec.source}; replaced: "
                               + ", ".join(changes))


@dataclass(frozen=True)
class ModelCost:
    """A decoder's costs per token: from its config.json sizes and parameter count."""

    params: int
    layers: int
    q: int  # attention heads x head_dim
    k: int  # kv heads x head_dim
    dtype_bytes: int = 2

    @classmethod
    def of(cls, arch, params: int, dtype_bytes: int = 2) -> ModelCost:
        return cls(params, arch.num_hidden_layers, arch.num_attention_heads * arch.head_dim,
                   arch.num_key_value_heads * arch.head_dim, dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.k * self.dtype_bytes  # K and V of every layer

    def forward_flops(self, length: int) -> float:
        """One forward over a causal row of `length` tokens."""
        return 2 * self.params * length + 2 * self.layers * self.q * length * length


@dataclass(frozen=True)
class StepCost:
    bytes: float
    flops: float
    seconds: float


def engine_step(gpu: GpuSpec, model: ModelCost, *, tokens: int, kv_tokens: int,
                attn_pairs: float) -> StepCost:
    """One engine step computing `tokens` tokens with `kv_tokens` tokens of KV cache in flight
    and `attn_pairs` (token, context token) attention pairs."""
    nbytes = model.weight_bytes + kv_tokens * model.kv_bytes_per_token
    flops = 2 * model.params * tokens + 4 * model.layers * model.q * attn_pairs
    seconds = max(nbytes / (gpu.hbm_bytes_per_s * MEM_EFFICIENCY),
                  flops / (gpu.bf16_flops * COMPUTE_EFFICIENCY)) + gpu.step_overhead_s
    return StepCost(nbytes, flops, seconds)


def kv_capacity_tokens(gpu: GpuSpec, model: ModelCost, memory_share: float) -> int:
    """Tokens of KV cache an engine with `memory_share` of the GPU holds."""
    free = memory_share * gpu.memory_gib * GIB - model.weight_bytes - ENGINE_RESERVE_BYTES
    if free <= 0:
        raise ValueError(f"a {memory_share} share of {gpu.name} leaves no KV cache")
    return int(free // model.kv_bytes_per_token)


# --------------------------------------------------------------------------------------------
# the engine on a virtual clock


class _Req:
    __slots__ = ("prefill", "ctx", "n_out", "start", "on_done", "seq", "done_at", "state",
                 "prefilled")

    def __init__(self, prefill: int, ctx: int, n_out: int, on_done, seq: int):
        self.prefill, self.ctx, self.n_out = prefill, ctx, n_out  # ctx: prompt length
        self.prefilled = 0
        self.start = -1  # the step whose prefill sampled its first token
        self.on_done, self.seq = on_done, seq  # on_done(req) -> whether a client may go on
        self.done_at = math.nan
        self.state = "waiting"


class VirtualEngine:
    """Continuous batching on one GPU, in virtual seconds (`now`); `busy_s`: time with work."""

    def __init__(self, gpu: GpuSpec, model: ModelCost, kv_capacity: int,
                 max_batched_tokens: int = MAX_BATCHED_TOKENS, max_num_seqs: int = MAX_NUM_SEQS):
        self.gpu, self.model, self.capacity = gpu, model, kv_capacity
        self.max_batched, self.max_seqs = max_batched_tokens, max_num_seqs
        self.now = self.busy_s = 0.0
        self.steps = self.preempted = 0
        self._waiting: deque[_Req] = deque()
        self._prefilling: list[_Req] = []
        self._decoding: list[_Req] = []  # admission order (the newest is preempted first)
        self._finish: list[tuple[int, int, _Req]] = []  # (last step, seq, req); lazy deletion
        self._kv = 0  # tokens in the KV cache of admitted requests
        self._kv_decoding = 0

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._prefilling or self._decoding)

    def add(self, req: _Req) -> None:
        self._waiting.append(req)

    def idle_until(self, t: float) -> None:
        self.now = max(self.now, t)

    def advance(self, until: float) -> list[_Req]:
        """Steps while the clock is before `until`, until one finishes a request (returned).

        Steps in which only decoding happens (nothing can be admitted, nothing prefills or
        ends, the cache does not overflow) differ only in their growing KV: they are summed
        here without the bookkeeping of `step`, with the same costs."""
        if self._decoding and not self._prefilling and self._finish and (
                not self._waiting or self._kv + self._waiting[0].ctx + 1 > self.capacity
                or len(self._decoding) >= self.max_seqs):
            g, m = self.gpu, self.model
            n, kv, kvd, t = len(self._decoding), self._kv, self._kv_decoding, self.now
            bw, peak = g.hbm_bytes_per_s * MEM_EFFICIENCY, g.bf16_flops * COMPUTE_EFFICIENCY
            w, kvb, attn = m.weight_bytes, m.kv_bytes_per_token, 4 * m.layers * m.q
            dense = 2 * m.params * n
            free = self._finish[0][0] - self.steps  # steps before the next possible end
            s0 = self.steps
            while free > 0 and t < until and kv + n <= self.capacity:
                t += max((w + kv * kvb) / bw, (dense + attn * kvd) / peak) + g.step_overhead_s
                kv += n
                kvd += n
                free -= 1
                self.steps += 1
            self.busy_s += t - self.now
            self.now, self._kv, self._kv_decoding = t, kv, kvd
            if self.steps > s0 and (t >= until or free > 0):
                return []
        return self.step()

    def step(self) -> list[_Req]:
        """One engine step; returns the requests it finished."""
        budget = self.max_batched - len(self._decoding)
        while self._waiting and len(self._prefilling) + len(self._decoding) < self.max_seqs:
            r = self._waiting[0]
            if self._kv + r.ctx + 1 > self.capacity and (self._prefilling or self._decoding):
                break
            self._waiting.popleft()
            r.state = "prefilling"
            self._prefilling.append(r)
            self._kv += r.ctx  # its blocks, cached prefix and prompt, are allocated now
        tokens, pairs, started = len(self._decoding), float(self._kv_decoding), []
        for r in self._prefilling:
            if budget <= 0:
                break
            c = min(budget, r.prefill - r.prefilled)
            pairs += c * (r.ctx - r.prefill + r.prefilled + c / 2)
            r.prefilled += c
            budget -= c
            tokens += c
            if r.prefilled == r.prefill:
                started.append(r)
        cost = engine_step(self.gpu, self.model, tokens=tokens, kv_tokens=self._kv,
                           attn_pairs=pairs)
        self.now += cost.seconds
        self.busy_s += cost.seconds
        s = self.steps
        self.steps += 1
        # every decoding sequence and every finished prefill sampled one token
        self._kv += len(self._decoding) + len(started)
        self._kv_decoding += len(self._decoding)
        for r in started:
            self._prefilling.remove(r)
            r.state, r.start = "decoding", s
            self._decoding.append(r)
            self._kv_decoding += r.ctx + 1
            heapq.heappush(self._finish, (s + r.n_out - 1, r.seq, r))
        done = []
        while self._finish and self._finish[0][0] <= s:
            last, _, r = heapq.heappop(self._finish)
            if r.state != "decoding" or r.start + r.n_out - 1 != last:
                continue  # preempted since
            r.state, r.done_at = "done", self.now
            self._decoding.remove(r)
            self._kv -= r.ctx + r.n_out
            self._kv_decoding -= r.ctx + r.n_out
            done.append(r)
        while self._kv > self.capacity and len(self._decoding) > 1:
            self._preempt(self._decoding[-1], s)
        return done

    def _preempt(self, r: _Req, s: int) -> None:
        """Back to the queue's head; its context so far is recomputed at readmission."""
        made = s - r.start + 1
        self._decoding.remove(r)
        held = r.ctx + made
        self._kv -= held
        self._kv_decoding -= held
        r.ctx, r.n_out, r.prefill, r.prefilled = held, r.n_out - made, held, 0
        r.state = "waiting"
        self._waiting.appendleft(r)
        self.preempted += 1


class _Waiter:
    __slots__ = ("pending", "event", "done", "blocked")

    def __init__(self, pending: int):
        self.pending, self.event, self.done = pending, threading.Event(), pending == 0
        self.blocked = False


class VirtualClock:
    """The agent loop's threads and the engine share one virtual time: it moves on only while
    every client thread is blocked (on the engine or on a search), so what the loop does in
    between costs no virtual time and the schedule does not depend on the host's speed. The
    agent loop runs in one thread (`client()`) under either schedule."""

    def __init__(self, engine: VirtualEngine):
        self.engine = engine
        self._lock = threading.RLock()
        self._clients = self._blocked = 0
        self._timers: list[tuple[float, int, _Waiter]] = []
        self._seq = 0

    @property
    def now(self) -> float:
        return self.engine.now

    @contextmanager
    def client(self):
        """The calling thread takes part while inside."""
        with self._lock:
            self._clients += 1
        try:
            yield self
        finally:
            with self._lock:
                self._clients -= 1
                if self._clients and self._blocked == self._clients:
                    self._advance()

    def submit(self, prefill: int, ctx: int, n_out: int, on_done) -> _Req:
        with self._lock:
            self._seq += 1
            r = _Req(prefill, ctx, n_out, on_done, self._seq)
            self.engine.add(r)
            return r

    def wait(self, waiter: _Waiter) -> None:
        with self._lock:
            if waiter.done:
                return
            waiter.blocked = True
            self._blocked += 1
            if self._blocked == self._clients:
                self._advance()
        waiter.event.wait()

    def sleep(self, seconds: float) -> None:
        w = _Waiter(1)
        with self._lock:
            self._seq += 1
            heapq.heappush(self._timers, (self.engine.now + seconds, self._seq, w))
        self.wait(w)

    def release(self, w: _Waiter) -> bool:
        """(Lock held.) One of `w`'s events happened; whether its client may go on."""
        w.pending -= 1
        if w.pending > 0 or w.done:
            return False
        w.done = True
        if w.blocked:
            self._blocked -= 1
        w.event.set()
        return True

    def _advance(self) -> None:
        """(Lock held, every client blocked.) Run the engine and the timers until a client
        can go on."""
        eng = self.engine
        while True:
            t_timer = self._timers[0][0] if self._timers else math.inf
            released = False
            if eng.has_work and eng.now < t_timer:
                for r in eng.advance(t_timer):
                    released |= r.on_done(r)
            elif self._timers:
                eng.idle_until(t_timer)
                while self._timers and self._timers[0][0] <= eng.now:
                    released |= self.release(heapq.heappop(self._timers)[2])
            else:
                raise RuntimeError("virtual clock: every client waits and nothing is pending")
            if released:
                return


# --------------------------------------------------------------------------------------------
# the simulated policy, tokenizer and retriever


@dataclass(frozen=True)
class TrajectoryShape:
    """What a simulated rollout samples. Tool calls per answer: P(calls = c) for c = 0..6,
    reached turn by turn (after c calls the policy answers with P(c) / P(>= c), else searches);
    every turn (thinking + action) log-normal in tokens; observations uniform in tokens (the
    three passages together)."""

    name: str
    calls: tuple[float, ...]
    turn_median: float
    turn_sigma: float
    obs_tokens: tuple[int, int] = (350, 500)
    source: str = ""

    @property
    def mean_calls(self) -> float:
        return sum(c * p for c, p in enumerate(self.calls))


# A2TGPO App. C.4 (validation, step 240, multi-hop): 3.45 calls on average, 72% use 2-4, 2.5%
# none; the rest spread so that the mean holds (max_tool_calls 6)
MULTI_HOP_CALLS = (0.025, 0.03, 0.20, 0.27, 0.25, 0.12, 0.105)
# turn lengths fitted to A2TGPO Fig. 8's maxima over a step's 1,024 responses (observations
# included), not to any time: GRPO's reach the 6,192-token budget (~0.8% of a step's responses
# cut), A2TGPO's fall to ~4,000 (4,000-4,130 over seeds)
SHAPES = {
    "grpo": TrajectoryShape("grpo", MULTI_HOP_CALLS, 200.0, 0.9,
                            source="Fig. 8: GRPO's maxima at the 6,192 limit"),
    "a2tgpo": TrajectoryShape("a2tgpo", MULTI_HOP_CALLS, 120.0, 0.45,
                              source="Fig. 8: A2TGPO's maxima ~4,000 after step ~50"),
}


class SimTokenizer:
    """Whitespace words as tokens: the protocol's tags are single ids, every other word gets
    the next free id. Enough for the agent loop (it decodes an action to read its query and
    encodes observations, never re-encodes what was sampled)."""

    FILLER = "w"
    PASSAGE = "p"  # passage text: a word of k of these letters is k tokens (no per-word cost)
    ASSISTANT = "<|assistant|>"  # ends the chat template: the response starts after it

    def __init__(self):
        self._lock = threading.Lock()
        self.words = ["<pad>", "<search>", "</search>", "<answer>", "</answer>", self.FILLER]
        self.ids = {w: i for i, w in enumerate(self.words)}
        self._passage = self.id(self.PASSAGE)

    def id(self, word: str) -> int:
        i = self.ids.get(word)
        if i is None:
            with self._lock:
                i = self.ids.setdefault(word, len(self.words))
                if i == len(self.words):
                    self.words.append(word)
        return i

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        get, out = self.ids.get, []
        for w in text.split():
            if w[0] == self.PASSAGE and w == self.PASSAGE * len(w):
                out += [self._passage] * len(w)  # a run of k passage letters: k tokens
            else:
                out.append(i if (i := get(w)) is not None else self.id(w))
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(self.words.__getitem__, ids))

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        return " ".join(m["content"] for m in messages) + " " + self.ASSISTANT


class SimRetriever:
    """Passages of drawn length for the simulated queries; each call sleeps its latency on
    the virtual clock. `wait_s`: trajectory-seconds spent waiting on searches."""

    def __init__(self, sleep, shape: TrajectoryShape, topk: int = 3):
        self.sleep, self.shape, self.topk = sleep, shape, topk
        self.wait_s = 0.0
        self.calls = 0

    def search(self, queries: list[str], topk: int):
        from a2tgpo.retrieval.base import Hit

        latency = SEARCH_BASE_S + SEARCH_PER_QUERY_S * len(queries)
        self.wait_s += latency * len(queries)
        self.calls += 1
        out = []
        for q in queries:
            rng = random.Random(f"obs {q}")
            words = rng.randint(*self.shape.obs_tokens) - 2 * topk  # "Page i:" per passage
            per = [words // topk + (i < words % topk) for i in range(topk)]
            out.append([Hit(f"{q}-{i}", f"t{i}{q}\n" + SimTokenizer.PASSAGE * (n - 1), 1.0)
                        for i, n in enumerate(per)])
        self.sleep(latency)
        return out

    def close(self) -> None:
        pass


class SimEngine:
    """The agent loop's engine (token ids in, sampled ids out) on a `VirtualClock`: a turn's
    length and action come from `shape` and the request's seed, its time from the engine's
    continuous batching. `generate` (waves: the whole batch, then return) and `submit` (one
    request, a Future; `wait_any`) use the same engine. `finished[seed]`: virtual time each
    turn ended."""

    def __init__(self, clock: VirtualClock, tok: SimTokenizer, shape: TrajectoryShape,
                 prefix_cache: bool = True, script: dict[int, tuple[int, bool]] | None = None):
        self.clock, self.tok, self.shape = clock, tok, shape
        self.prefix_cache = prefix_cache
        self.script = script or {}  # seed -> (tokens, answers): turns given, not drawn
        self._seen_prompts: set[tuple[int, ...]] = set()
        self.finished: dict[int, float] = {}
        self.submitted: dict[int, float] = {}
        self._close = tok.id("</search>")
        self._turns = tok.id(SimTokenizer.ASSISTANT)
        self._unfinished = 0
        self._any: _Waiter | None = None

    def _turn(self, prompt: list[int], max_tokens: int, seed: int):
        from a2tgpo.rollout.engine import Generation

        rng = random.Random(seed)
        calls = self._response(prompt).count(self._close)
        p = self.shape.calls
        answer = calls >= len(p) - 1 or rng.random() < p[calls] / sum(p[calls:])
        n = max(4, round(rng.lognormvariate(math.log(self.shape.turn_median),
                                            self.shape.turn_sigma)))
        n, answer = self.script.get(seed, (n, answer))
        tail = ["<answer>", "a", "</answer>"] if answer else ["<search>", f"q{seed}", "</search>"]
        if n > max_tokens:
            ids = [self.tok.id(SimTokenizer.FILLER)] * max_tokens
            return Generation(tuple(ids), (-1.0,) * len(ids), "length")
        ids = [self.tok.id(SimTokenizer.FILLER)] * (n - 3) + [self.tok.id(w) for w in tail]
        return Generation(tuple(ids), (-1.0,) * n, "stop", tail[-1])

    def _response(self, prompt: list[int]) -> list[int]:
        """What follows the chat template's generation prompt: the turns so far (the system
        prompt itself names the tags)."""
        return prompt[prompt.index(self._turns) + 1:]

    def _uncached(self, prompt: list[int]) -> int:
        """Prefill tokens under prefix caching: after the sequence's last action (its KV stays
        cached), or the whole question the first time a group's prompt is seen."""
        response = self._response(prompt)
        if self._close in response:
            return response[::-1].index(self._close)
        key = tuple(prompt)
        if key in self._seen_prompts:
            return 1
        self._seen_prompts.add(key)
        return len(prompt)

    def _request(self, prompt: list[int], params, seed: int, on_done):
        g = self._turn(prompt, params.max_tokens, seed)
        self.submitted[seed] = self.clock.now

        def done(r: _Req) -> bool:
            self.finished[seed] = r.done_at
            return on_done(r, g)

        self.clock.submit(max(1, self._uncached(prompt)), len(prompt), len(g.token_ids), done)
        return g

    def generate(self, prompts, params, seeds=None):
        """The wave schedule's call: every prompt at once, back when the last one ends."""
        if seeds is None:
            raise ValueError("the simulated engine samples by the agent's per-turn seeds")
        waiter = _Waiter(len(prompts))
        out = [self._request(list(p), params, s, lambda r, g: self.clock.release(waiter))
               for p, s in zip(prompts, seeds, strict=True)]
        self.clock.wait(waiter)
        return out

    # the per-trajectory schedule's `Streaming` interface (a2tgpo.rollout.engine)
    def submit(self, prompt_ids, params, seed: int) -> Future:
        fut: Future = Future()
        self._unfinished += 1

        def done(r: _Req, g) -> bool:
            self._unfinished -= 1
            fut.set_result(g)
            w, self._any = self._any, None
            return w is not None and self.clock.release(w)

        self._request(list(prompt_ids), params, seed, done)
        return fut

    def wait_any(self) -> None:
        if not self._unfinished:
            return
        self._any = _Waiter(1)
        self.clock.wait(self._any)

    def cancel(self) -> None:
        raise RuntimeError("the simulated engine runs every request it was given")

    def update_weights(self, state_dict) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# a rollout of one rank, and a step


@dataclass(frozen=True)
class RolloutTiming:
    """One rank's rollout on the virtual clock."""

    seconds: float
    busy_s: float  # the engine had work
    longest_trajectory_s: float  # first turn submitted to last turn finished
    search_wait_s: float  # trajectory-seconds waiting on searches, per trajectory
    steps: int  # engine steps
    preempted: int
    lengths: tuple[int, ...]  # per trajectory: prompt + response tokens
    responses: tuple[int, ...]  # response tokens (sampled + observations)
    prefixes: tuple[tuple[int, ...], ...]  # per trajectory: tokens before each turn's end

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.seconds if self.seconds else 1.0


def _builders(tok: SimTokenizer, agent_cfg, questions: int, n: int, seed: int) -> list:
    from a2tgpo.rollout.agent import prompt_ids
    from a2tgpo.rollout.trajectory import TrajectoryBuilder

    out = []
    for q in range(questions):
        ids = prompt_ids(tok, f"simulated question {seed} {q}", agent_cfg.prompt_style)
        out += [TrajectoryBuilder(ids, question_id=str(q), group_id=q) for _ in range(n)]
    return out


def _tool(retriever, tok, agent_cfg, topk: int):
    from a2tgpo.retrieval.retriever import RetrievalConfig
    from a2tgpo.rollout.agent import SearchTool

    return SearchTool(retriever, tok, agent_cfg,
                      RetrievalConfig(topk=topk, max_passage_chars=10**6))


def _timing(builders, sims: list[SimEngine], engines: list[VirtualEngine],
            retriever: SimRetriever, seed: int) -> RolloutTiming:
    from a2tgpo.rollout.agent import _seed

    finished = {k: v for s in sims for k, v in s.finished.items()}
    submitted = {k: v for s in sims for k, v in s.submitted.items()}
    longest, prefixes = 0.0, []
    for i, b in enumerate(builders):
        seeds = [_seed(seed, i, t) for t in range(len(b.turns))]
        longest = max(longest, finished[seeds[-1]] - submitted[seeds[0]])
        ends, at = [], len(b.prompt_ids)
        for t in b.turns:
            at += len(t.action_ids)
            ends.append(at)
            at += len(t.obs_ids)
        prefixes.append(tuple(ends))
    seconds = max(e.now for e in engines)
    return RolloutTiming(
        seconds=seconds, busy_s=sum(e.busy_s for e in engines) / len(engines),
        longest_trajectory_s=longest, search_wait_s=retriever.wait_s / len(builders),
        steps=max(e.steps for e in engines), preempted=sum(e.preempted for e in engines),
        lengths=tuple(len(b) for b in builders),
        responses=tuple(len(b) - len(b.prompt_ids) for b in builders),
        prefixes=tuple(prefixes))


def simulate_rank(gpu: GpuSpec, model: ModelCost, shape: TrajectoryShape, *, questions: int,
                  n: int, agent_cfg, schedule: str = "waves", memory_share: float = 0.6,
                  seed: int = 0, topk: int = 3, script: dict | None = None,
                  out: list | None = None) -> RolloutTiming:
    """One rank's rollouts (`questions` x `n` chains) through the real agent loop
    (a2tgpo.rollout.agent `continue_rollouts`) on a simulated engine, under `schedule` (the
    agent's `rollout.schedule`: waves = each wave waits for its longest turn; trajectory =
    each chain submits its next turn when its own search returns). `script`: SimEngine's;
    `out`: receives the trajectory builders."""
    from a2tgpo.rollout.agent import continue_rollouts

    if schedule not in ("waves", "trajectory"):
        raise ValueError(f"schedule {schedule!r}: waves or trajectory")
    engine = VirtualEngine(gpu, model, kv_capacity_tokens(gpu, model, memory_share))
    clock = VirtualClock(engine)
    tok = SimTokenizer()
    sim = SimEngine(clock, tok, shape, script=script)
    retriever = SimRetriever(clock.sleep, shape, topk)
    builders = _builders(tok, agent_cfg, questions, n, seed)
    if out is not None:
        out.extend(builders)
    with clock.client():
        continue_rollouts(builders, sim, _tool(retriever, tok, agent_cfg, topk),
                          dataclasses.replace(agent_cfg, schedule=schedule), seed=seed)
    return _timing(builders, [sim], [engine], retriever, seed)


class _Lockstep:
    """verl's generation manager (Search-R1, IGPO): each turn, one generate call over every
    live trajectory of the step, split evenly over the GPUs' engines; the turn ends when the
    slowest engine's share does. Its engines keep no prefix cache across calls (verl frees the
    cache between generate calls), so every turn prefills its whole context."""

    def __init__(self, sims: list[SimEngine]):
        self.sims = sims

    def _sync(self, extra: float = 0.0) -> None:
        t = max(s.clock.engine.now for s in self.sims) + extra
        for s in self.sims:
            s.clock.engine.idle_until(t)

    def generate(self, prompts, params, seeds=None):
        k = len(self.sims)
        out = []
        for r, sim in enumerate(self.sims):
            lo, hi = r * len(prompts) // k, (r + 1) * len(prompts) // k
            if hi > lo:
                with sim.clock.client():
                    out += sim.generate(prompts[lo:hi], params, seeds[lo:hi])
        self._sync()
        return out

    def sleep(self, seconds: float) -> None:
        """A search: every engine idles until it returns."""
        self._sync(seconds)


def simulate_lockstep(gpu: GpuSpec, model: ModelCost, shape: TrajectoryShape, *, prompts: int,
                      n: int, ranks: int, agent_cfg, memory_share: float = 0.6, seed: int = 0,
                      topk: int = 3) -> RolloutTiming:
    """The step's rollouts as the papers' stack ran them (`_Lockstep`): waves across all
    `ranks` GPUs, no prefix cache; the same agent loop, shapes and engine model."""
    from a2tgpo.rollout.agent import continue_rollouts

    tok = SimTokenizer()
    engines = [VirtualEngine(gpu, model, kv_capacity_tokens(gpu, model, memory_share))
               for _ in range(ranks)]
    sims = [SimEngine(VirtualClock(e), tok, shape, prefix_cache=False) for e in engines]
    lock = _Lockstep(sims)
    retriever = SimRetriever(lock.sleep, shape, topk)
    builders = _builders(tok, agent_cfg, prompts, n, seed)
    continue_rollouts(builders, lock, _tool(retriever, tok, agent_cfg, topk),
                      dataclasses.replace(agent_cfg, schedule="waves"), seed=seed)
    return _timing(builders, sims, engines, retriever, seed)


# information-gain probe tokens per turn: the ground-truth answer in its template (`<answer>
# ... </answer>` around a short answer, ~20-40 tokens)
PROBE_TOKENS = 30


@dataclass(frozen=True)
class StepRollouts:
    """The rollouts of one step on `ranks` GPUs: the step waits for its slowest rank."""

    ranks: tuple[RolloutTiming, ...]

    @property
    def seconds(self) -> float:
        return max(r.seconds for r in self.ranks)

    @property
    def slowest(self) -> RolloutTiming:
        return max(self.ranks, key=lambda r: r.seconds)

    @property
    def lengths(self) -> list[int]:
        return [n for r in self.ranks for n in r.lengths]

    @property
    def prefixes(self) -> list[tuple[int, ...]]:
        return [p for r in self.ranks for p in r.prefixes]


def simulate_step(gpu: GpuSpec, model: ModelCost, shape: TrajectoryShape, *, prompts: int,
                  n: int, ranks: int, agent_cfg, schedule: str = "waves",
                  memory_share: float = 0.6, seed: int = 0) -> StepRollouts:
    """Each rank rolls out its prompts / ranks questions x n (as rl.py shards a step)."""
    per = max(1, prompts // ranks)
    return StepRollouts(tuple(
        simulate_rank(gpu, model, shape, questions=per, n=n, agent_cfg=agent_cfg,
                      schedule=schedule, memory_share=memory_share, seed=seed * 1009 + r)
        for r in range(ranks)))


def training_seconds(model: ModelCost, lengths: Sequence[int],
                     prefixes: Sequence[Sequence[int]], *, gpu: GpuSpec, gpus: int, mfu: float,
                     ppo_epochs: int = 1, reference: bool = False, ig: str | None = None,
                     checkpointing: bool = True) -> dict[str, float]:
    """Seconds of the passes after the rollout, from FLOPs at `mfu` of `gpus` GPUs' peak.

    ig None: no information gain; "fused": ours, one forward per trajectory over its tokens
    and each turn's probe (it also gives the old log-probs); "per_prefix": IGPO's released
    pass, one row per (trajectory, turn) prefix plus the probe, in the same call as the old
    log-probs (A2TGPO Fig. 7's "IG" bar, which replaced GRPO's old log-prob time)."""
    rate = gpus * gpu.bf16_flops * mfu
    full = sum(model.forward_flops(n) for n in lengths)
    per_token = 2 * model.params
    out = {"old_logprob": full / rate, "reference": full / rate if reference else 0.0,
           "ig": 0.0}
    if ig == "fused":
        probes = sum(len(p) * PROBE_TOKENS * (per_token + 4 * model.layers * model.q * n)
                     for p, n in zip(prefixes, lengths, strict=True))
        out["ig"], out["old_logprob"] = (full + probes) / rate, 0.0
    elif ig == "per_prefix":
        rows = sum(model.forward_flops(e + PROBE_TOKENS) for p in prefixes for e in p)
        out["ig"], out["old_logprob"] = (full + rows) / rate, 0.0
    elif ig is not None:
        raise ValueError(f"ig {ig!r}: None, fused or per_prefix")
    out["update"] = ppo_epochs * (4 if checkpointing else 3) * full * PACKING / rate
    return out
