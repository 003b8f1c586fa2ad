"""Token log-probabilities and entropies from final hidden states, in chunks of tokens.

A full-vocabulary log-softmax materialises (tokens, V) float32 tensors: at 8 x 6144 tokens and
V = 151,936 one such tensor is 29.9 GB. Here the output layer is applied to `chunk` tokens at a
time, each chunk's log-softmax reduced at once to the two numbers per token that are read
(the target's log-prob and, optionally, the entropy). With gradients, each chunk runs under
activation checkpointing, so backward recomputes the chunk's logits instead of keeping them:
the peak is one chunk's (chunk, V) float32 tensors, whatever the sequence length.

The values are those of the full computation (log_softmax of the float32 logits, then gather),
up to float32 round-off of the matmul's blocking.

Shape legend: N tokens (flattened positions), H hidden size, V vocabulary.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

# tokens per chunk: 512 x 151,936 x 4 B = 0.3 GB per float32 (chunk, V) tensor; a chunk holds
# about three of them at once (logits, log-softmax, the entropy's exp), measured by
# bench/logprob_memory.py
DEFAULT_CHUNK_TOKENS = 512


def entropy_from_logprobs(*, logp_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy per token from normalised log-probabilities: H = −Σ_v p_v log p_v, p = exp(log p).

    Shapes: logp_BTV (..., V) -> (...).
    """
    return -(logp_BTV.exp() * logp_BTV).sum(-1)


def _chunk_stats(hidden_NH: torch.Tensor, project, target_N, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    logp_NV = torch.log_softmax(project(hidden_NH).float(), dim=-1)
    lp = logp_NV.gather(-1, target_N[:, None]).squeeze(-1)
    ent = entropy_from_logprobs(logp_BTV=logp_NV) if with_entropy else torch.zeros_like(lp)
    return lp, ent


def chunked_logprobs(*, hidden_NH: torch.Tensor, project, target_N: torch.Tensor,
                     with_entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(project(h))[target] per token, and the entropy of that distribution.

    `project` maps hidden states to logits, (n, H) -> (n, V): the model's output layer (a
    module, so that ZeRO-3's gather hooks run for each chunk). Differentiable in hidden_NH
    and project's parameters; under autograd each chunk is checkpointed (its logits are
    recomputed in backward, not stored).

    Shapes: hidden_NH (N, H), target_N (N,) long -> logp_N (N,) float32, entropy_N (N,)
    float32 or None.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    grad = torch.is_grad_enabled()
    lps, ents = [], []
    for s in range(0, hidden_NH.shape[0], chunk_tokens):
        args = (hidden_NH[s: s + chunk_tokens], project, target_N[s: s + chunk_tokens],
                with_entropy)
        lp, ent = (checkpoint(_chunk_stats, *args, use_reentrant=False) if grad
                   else _chunk_stats(*args))
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden_NH.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)
