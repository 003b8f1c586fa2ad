"""The token-in/token-out generation interface the agent loop talks to.

An engine takes prompts as token ids and returns, per prompt, the sampled token ids exactly as
sampled, the log-probability of each sampled token, and why generation stopped. Nothing is
decoded and re-encoded: stop strings are detected on the decoded text of the ids generated so
far, and the ids up to and including the token that completes a stop string are returned (the
stop string stays in the output, as the papers' rollouts keep `</search>`).

Two implementations: `hf` (a2tgpo.rollout.hf_engine; CPU or GPU, batched, KV cache) and `vllm`
(a2tgpo.rollout.vllm_engine; vLLM's offline engine from token ids).

Log-probabilities are those of the model's raw next-token distribution (before temperature and
top-p), as vLLM reports them by default (`logprobs_mode=raw_logprobs`); at temperature 1 and
top-p 1 they are the sampling distribution's.
"""

from __future__ import annotations

from dataclasses import dataclass
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
