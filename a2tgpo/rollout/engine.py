"""The token-in/token-out generation interface the agent loop talks to.

An engine takes prompts as token ids and returns, per prompt, the sampled token ids exactly as
sampled, the log-probability of each sampled token, and why generation stopped. Nothing is
decoded and re-encoded: stop strings are detected on the decoded text of the ids generated so
far, and the ids up to and including the token that completes a stop string are returned (the
stop string stays in the output, as the papers' rollouts keep `</search>`).

Two implementations: `hf` (a2tgpo.rollout.hf_engine; CPU or GPU, batched, KV cache) and `vllm`
(a2tgpo.rollout.vllm_engine; vLLM's offline engine from token ids).

Requests one at a time (`Streaming`), for the per-trajectory schedule (a2tgpo.rollout.agent):
`submit(prompt_ids, params, seed)` returns a `concurrent.futures.Future[Generation]` at once;
`wait_any()` blocks until at least one submitted request has its result set (or returns at
once when none is unfinished); `cancel()` drops every unfinished request (the driver gave up
on them: a stop request, an error). That is the whole interface: a driver submits a trajectory's
next turn as soon as it is ready and calls `wait_any()` when it has nothing else to do, so an
engine may run requests as they come (vLLM: continuous batching), or batch whatever is pending
when asked to wait (`Batching`, which runs `generate`), or advance a virtual clock to the next
completion (a simulator). The futures are set in the thread that calls `wait_any()` or by the
engine's own threads; a driver reads them only after `wait_any()` returns.

Log-probabilities are those of the model's raw next-token distribution (before temperature and
top-p), as vLLM reports them by default (`logprobs_mode=raw_logprobs`); at temperature 1 and
top-p 1 they are the sampling distribution's.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Literal, Protocol

StopReason = Literal["stop", "eos", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one turn."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    greedy: bool = False  # argmax (validation); temperature and top_p are then ignored

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not self.greedy and self.temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy=True for argmax)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


@dataclass(frozen=True)
class Generation:
    """One prompt's sampled continuation."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: StopReason  # stop string, end-of-sequence token, or max_tokens
    stop_string: str | None = None  # which stop string ended it

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("one logprob per sampled token")


class Engine(Protocol):
    """Token ids in; sampled ids, per-token logprobs and stop reason out."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        """One continuation per prompt. `seeds[i]` seeds prompt i's sampling, so a prompt's
        result does not depend on what else is in the batch (where the engine allows)."""
        ...

    def update_weights(self, state_dict: dict) -> None:
        """Load the trainer's current weights (same names as the HF model's state dict)."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory between rollouts (no-op where not supported)."""
        ...

    def wake(self) -> None:
        ...


class Streaming(Protocol):
    """Requests one at a time, results as futures (module docstring)."""

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               seed: int | None) -> Future[Generation]:
        """Queue or start one request; its future gets the `Generation` (or the exception)."""
        ...

    def wait_any(self) -> None:
        """Block until at least one unfinished request's future is set; at once if none is."""
        ...

    def cancel(self) -> None:
        """Drop every unfinished request; their futures are never set."""
        ...


class Batching:
    """`Streaming` over an engine that only has `generate`: requests wait until `wait_any`,
    which runs everything pending, in submission order, in one `generate` call per set of
    sampling parameters that differ in more than `max_tokens`.

    Each such call samples up to the largest `max_tokens` of its requests, and a request with
    a smaller one gets a prefix of its ids (stop "length" where cut). Per-request seeds make
    the prefix what the request would have sampled alone, and a batch holds exactly the rows
    the wave schedule's one `generate` call holds when every trajectory is at the same turn,
    so on the hf engine the two schedules give the same ids (agent.py, "Schedules").
    """

    def __init__(self, engine):
        self.engine = engine
        self.pending: list[tuple[list[int], SamplingParams, int | None, Future]] = []

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               seed: int | None) -> Future[Generation]:
        fut: Future[Generation] = Future()
        self.pending.append((list(prompt_ids), params, seed, fut))
        return fut

    def wait_any(self) -> None:
        pending, self.pending = self.pending, []
        groups: dict[SamplingParams, list] = {}
        for req in pending:  # insertion-ordered: a group keeps submission order
            groups.setdefault(replace(req[1], max_tokens=1), []).append(req)
        for key, reqs in groups.items():
            params = replace(key, max_tokens=max(r[1].max_tokens for r in reqs))
            try:
                gens = self.engine.generate([r[0] for r in reqs], params,
                                            seeds=[r[2] for r in reqs])
            except BaseException as e:
                for r in reqs:
                    r[3].set_exception(e)
                raise
            for (_, p, _, fut), g in zip(reqs, gens, strict=True):
                fut.set_result(_cut(g, p.max_tokens))

    def cancel(self) -> None:
        self.pending = []


def _cut(g: Generation, max_tokens: int) -> Generation:
    """`g` as a request of `max_tokens` would have ended: its first `max_tokens` ids."""
    if len(g.token_ids) <= max_tokens:
        return g
    return Generation(g.token_ids[:max_tokens], g.logprobs[:max_tokens], "length")


def streaming(engine) -> Streaming:
    """The engine itself where it streams (has `submit`), else `Batching` over it."""
    return engine if hasattr(engine, "submit") else Batching(engine)
