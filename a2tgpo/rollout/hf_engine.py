"""`hf` engine: batched token-in/token-out sampling with a KV cache, on CPU or GPU.

An explicit decode loop over a Hugging Face causal LM (rather than `model.generate`) because the
agent needs, per sequence: the exact sampled ids and the raw log-probability of each,
its own stop strings and its own seed, and to leave the batch as soon as it stops (finished rows
are dropped from the KV cache, so the batch shrinks instead of padding to the longest row).

Determinism: each prompt's sampling draws from its own `torch.Generator` seeded by its seed,
so a prompt's continuation does not depend on which other prompts share the batch (up to the
float effects of padding on the forward pass).
"""

from __future__ import annotations

import logging

import torch

from a2tgpo.rollout.engine import Generation, SamplingParams

log = logging.getLogger(__name__)


class HfEngine:
    """The Engine protocol over an `AutoModelForCausalLM` and its tokenizer."""

    def __init__(self, model, tokenizer, *, eos_token_ids: list[int] | None = None,
                 max_batch: int = 64):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        eos = eos_token_ids
        if eos is None:
            gen_eos = model.generation_config.eos_token_id
            eos = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
            if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
                eos.append(tokenizer.eos_token_id)
        self.eos = set(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
        self.max_batch = max_batch
        self.tokens_generated = 0

    # -- Engine protocol --------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError("one seed per prompt")
        seeds = seeds if seeds is not None else list(range(len(prompts)))
        out: list[Generation] = []
        for s in range(0, len(prompts), self.max_batch):
            out += self._generate_batch(prompts[s: s + self.max_batch], params,
                                        seeds[s: s + self.max_batch])
        return out

    def update_weights(self, state_dict: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        # tied embeddings appear under one name only; anything else missing is an error
        missing = [m for m in missing if not m.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")

    def sleep(self) -> None:
        pass  # the trainer and this engine share one model object: nothing to free

    def wake(self) -> None:
        pass

    # -- internals --------------------------------------------------------------------------

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        seeds: list[int]) -> list[Generation]:
        from transformers import DynamicCache

        B = len(prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        P = max(len(p) for p in prompts)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        attn = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):  # left padding: every row's next token is at column P
            ids[b, P - len(p):] = torch.tensor(p)
            attn[b, P - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator(device=self.device).manual_seed(int(sd)) for sd in seeds]

        cache = DynamicCache()
        # logits_to_keep=1: only the next token's logits (a 150k vocabulary x prompt length
        # would otherwise be materialised for nothing)
        logits = self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                            past_key_values=cache, use_cache=True,
                            logits_to_keep=1).logits[:, -1].float()
        rows = list(range(B))  # original index of each live row
        next_pos = pos[:, -1] + 1
        toks: list[list[int]] = [[] for _ in range(B)]
        lps: list[list[float]] = [[] for _ in range(B)]
        done: list[tuple[str, str | None] | None] = [None] * B
        max_stop = max((len(s) for s in params.stop), default=0)

        for step in range(params.max_tokens):
            logp = torch.log_softmax(logits, dim=-1)  # raw distribution
            chosen = self._sample(logits, params, [gens[r] for r in rows])
            # one device->host transfer per step, not one per row
            step_tok = chosen.tolist()
            step_lp = logp.gather(-1, chosen[:, None])[:, 0].tolist()
            keep = []
            for i, r in enumerate(rows):
                tok = step_tok[i]
                toks[r].append(tok)
                lps[r].append(step_lp[i])
                if tok in self.eos:
                    done[r] = ("eos", None)
                elif params.stop and (hit := self._stop_hit(toks[r], params.stop, max_stop)):
                    done[r] = ("stop", hit)
                elif step == params.max_tokens - 1:
                    done[r] = ("length", None)
                else:
                    keep.append(i)
            self.tokens_generated += len(rows)
            if not keep:
                break
            if len(keep) < len(rows):  # finished rows leave the batch and the cache
                idx = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(idx)
                attn, next_pos, chosen = attn[idx], next_pos[idx], chosen[idx]
                rows = [rows[i] for i in keep]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
            logits = self.model(input_ids=chosen[:, None].to(self.device), attention_mask=attn,
                                position_ids=next_pos[:, None], past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits[:, -1].float()
            next_pos = next_pos + 1
        return [Generation(tuple(toks[b]), tuple(lps[b]), done[b][0], done[b][1])
                for b in range(B)]

    def _sample(self, logits: torch.Tensor, params: SamplingParams,
                gens: list[torch.Generator]) -> torch.Tensor:
        """One token per row, on the device. Shapes: logits (b, V) -> (b,) long.

        Gumbel-max: argmax(log p + G) with G = −log(−log U) is a sample from p; each row's U
        comes from its own generator, which is what makes rows independent of each other.
        """
        if params.greedy:
            return logits.argmax(-1)
        scaled = torch.log_softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            # keep the smallest set of most likely tokens whose mass reaches top_p
            sorted_lp, order = scaled.sort(-1, descending=True)
            before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
            sorted_lp = sorted_lp.masked_fill(before >= params.top_p, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_lp)
        V = logits.shape[-1]
        u = torch.stack([torch.rand(V, generator=g, device=self.device) for g in gens])
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-20)))
        return (scaled + gumbel).argmax(-1)

    def _stop_hit(self, toks: list[int], stops: tuple[str, ...], max_stop: int) -> str | None:
        """The stop string the last token completed, if any (checked on decoded text only)."""
        # the new token can complete a stop string that began up to max_stop chars earlier;
        # decoding the last max_stop + 1 tokens covers that (every token is >= 1 char)
        tail = self.tokenizer.decode(toks[-(max_stop + 1):])
        prev = self.tokenizer.decode(toks[-(max_stop + 1):-1]) if len(toks) > 1 else ""
        for s in stops:
            if s in tail and not s in prev:  # noqa: E713 (reads as the rule it is)
                return s
        return None
