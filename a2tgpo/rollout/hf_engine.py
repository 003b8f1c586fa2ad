"""`hf` engine: batched token-in/token-out sampling with a KV cache, on CPU or GPU.

An explicit decode loop over a Hugging Face causal LM (rather than `model.generate`) because the
agent needs, per sequence: the exact sampled ids and the raw log-probability of each,
its own stop strings and its own seed, and to leave the batch as soon as it stops (finished rows
are dropped from the KV cache, so the batch shrinks instead of padding to the longest row).

Prefix cache: an agent's next turn is its previous input, the tokens just sampled and an
observation, and a question's rollouts share one prompt. Each call keeps every finished row's
keys and values (under a byte budget); the next call prefills only what follows the longest
kept prefix of each prompt, and identical prompts once. Without it every wave re-prefilled
the whole history: half the toy's rollout time (300k prefilled tokens for 18k sampled). Kept
entries live for one call and are dropped when the weights change (parameter versions). The
prompts' longest common prefix (the instructions every question shares) is run once per call
and kept the same way, for the first wave of an evaluation's different questions.

Decoding appends each token's keys and values in place, where transformers' `DynamicCache`
copies the whole cache at every token (`a2tgpo.model.fast_decode.new_cache`: only on the
transformers versions it was verified against; `fast_path=False` forces the stock cache).
bench/decode.py measures it against the stock path.

Context: with `max_model_len` (the backbone's), as in vLLM, a row stops ("length") when its
prompt and sampled ids fill the context, and a prompt that leaves no room is refused. The
rollout's budgets fit the context (`TrainConfig` checks it), so the limit binds only on a
prompt longer than that check leaves room for.

Determinism: each prompt's sampling draws from its own `torch.Generator` seeded by its seed,
so a prompt's continuation does not depend on which other prompts share the batch (up to the
float effects of padding on the forward pass).
"""

from __future__ import annotations

import logging

import torch

from a2tgpo.model.fast_decode import new_cache
from a2tgpo.rollout.engine import Generation, SamplingParams

log = logging.getLogger(__name__)


class HfEngine:
    """The Engine protocol over an `AutoModelForCausalLM` and its tokenizer."""

    def __init__(self, model, tokenizer, *, eos_token_ids: list[int] | None = None,
                 max_batch: int = 64, prefix_cache_bytes: int = 1 << 30,
                 fast_path: bool = True, common_prefix: bool = True,
                 max_model_len: int | None = None):
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.model = model
        self.max_model_len = max_model_len  # prompt + sampled ids per row; None = no limit
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
        self.tokens_prefilled = 0  # prompt tokens run through the model
        self.tokens_reused = 0  # prompt tokens whose keys/values came from the prefix cache
        self.prefix_cache_bytes = prefix_cache_bytes  # 0: no prefix cache, no shared prompts
        # the baselines of bench/decode.py: fast_path False = transformers' DynamicCache (so
        # is an unverified transformers), common_prefix False = every prompt prefilled whole
        self.fast_path = fast_path
        self.common_prefix = common_prefix
        # prompt + sampled ids (all but the last) -> per layer (keys, values), (kv_heads, n, d)
        self._kept: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._kept_lengths: list[int] = []  # distinct key lengths, longest first
        self._kept_version: tuple | None = None

    # -- Engine protocol --------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: list[int] | None = None) -> list[Generation]:
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError("one seed per prompt")
        seeds = seeds if seeds is not None else list(range(len(prompts)))
        if self._kept_version != self._weights_version():
            self._kept = {}  # keys and values of other weights
        self._new: dict[tuple[int, ...], list] = {}
        self._new_bytes = 0
        if self.prefix_cache_bytes and self.common_prefix and prompts:
            self._keep_common_prefix(prompts)
        out: list[Generation] = []
        for s in range(0, len(prompts), self.max_batch):
            out += self._generate_batch(prompts[s: s + self.max_batch], params,
                                        seeds[s: s + self.max_batch])
        self._kept, self._kept_version = self._new, self._weights_version()
        self._kept_lengths = sorted({len(k) for k in self._kept}, reverse=True)
        return out

    def update_weights(self, state_dict: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        # tied embeddings appear under one name only; anything else missing is an error
        missing = [m for m in missing if not m.endswith("lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        self._kept = {}

    def sleep(self) -> None:
        pass  # the trainer and this engine share one model object: nothing to free

    def wake(self) -> None:
        pass

    # -- internals --------------------------------------------------------------------------

    @torch.inference_mode()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        seeds: list[int]) -> list[Generation]:
        B = len(prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        cap = self.max_model_len
        if cap is not None and (longest := max(len(p) for p in prompts)) >= cap:
            raise ValueError(f"a prompt of {longest} tokens leaves no room in the context of "
                             f"max_model_len {cap} tokens (the backbone's)")
        cache, logits, attn = self._prefill(prompts)
        next_pos = torch.tensor([len(p) for p in prompts], device=self.device)
        gens = [torch.Generator(device=self.device).manual_seed(int(sd)) for sd in seeds]
        rows = list(range(B))  # original index of each live row
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
                elif (step == params.max_tokens - 1
                      or cap is not None and len(prompts[r]) + len(toks[r]) >= cap):
                    done[r] = ("length", None)
                else:
                    keep.append(i)
            self.tokens_generated += len(rows)
            if len(keep) < len(rows):
                self._keep_rows(cache, attn, [(i, r) for i, r in enumerate(rows)
                                              if done[r] is not None], prompts, toks)
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

    def _prefill(self, prompts: list[list[int]]):
        """The KV cache and next-token logits of every prompt, and the attention mask over the
        cache's columns. Shapes: -> cache (B, ·, C + S, ·), logits (B, V), attn (B, C + S).

        Row b's longest kept prefix (c_b tokens, at least one token short of the prompt, so
        that its last token is run and gives the logits) is placed right-aligned in the first
        C columns, its s_b remaining tokens right-aligned in the last S; the columns between
        are masked out, and positions are given explicitly, so each row sees exactly its own
        tokens at positions 0..len-1. Identical prompts are run once and copied (both off with
        prefix_cache_bytes 0)."""
        if self.prefix_cache_bytes:
            index: dict[tuple[int, ...], int] = {}
            expand = [index.setdefault(tuple(p), len(index)) for p in prompts]
            uniq = list(index)
        else:  # the plain path: every row prefilled whole
            expand, uniq = list(range(len(prompts))), [tuple(p) for p in prompts]
        hits = [self._longest_kept(p) for p in uniq]  # (kept entry or None, c_b)
        C = max(c for _, c in hits)
        S = max(len(p) - c for p, (_, c) in zip(uniq, hits, strict=True))
        U = len(uniq)
        ids = torch.full((U, S), self.pad_id, dtype=torch.long)
        attn = torch.zeros(U, C + S, dtype=torch.long)
        pos = torch.zeros(U, S, dtype=torch.long)
        for u, (p, (_, c)) in enumerate(zip(uniq, hits, strict=True)):
            s = len(p) - c
            ids[u, S - s:] = torch.tensor(p[c:])
            pos[u, S - s:] = torch.arange(c, len(p))
            attn[u, C - c: C] = 1
            attn[u, C + S - s:] = 1
        cache = self._new_cache()
        if C:
            n_layers = len(next(e for e, _ in hits if e is not None))
            for layer in range(n_layers):
                ref_k, ref_v = next(e for e, _ in hits if e is not None)[layer]
                K = ref_k.new_zeros(U, ref_k.shape[0], C, ref_k.shape[2])
                V = ref_v.new_zeros(U, ref_v.shape[0], C, ref_v.shape[2])
                for u, (e, c) in enumerate(hits):
                    if c:
                        K[u, :, C - c:] = e[layer][0][:, :c]
                        V[u, :, C - c:] = e[layer][1][:, :c]
                cache.update(K, V, layer)
        self.tokens_reused += sum(c for _, c in hits)
        self.tokens_prefilled += sum(len(p) for p in uniq) - sum(c for _, c in hits)
        attn = attn.to(self.device)
        # logits_to_keep=1: only the next token's logits (a 150k vocabulary x prompt length
        # would otherwise be materialised for nothing)
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attn,
                            position_ids=pos.to(self.device), past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1].float()
        if expand != list(range(U)):
            idx = torch.tensor(expand, device=self.device)
            cache.batch_select_indices(idx)
            logits, attn = logits[idx], attn[idx]
        return cache, logits, attn

    @torch.inference_mode()
    def _keep_common_prefix(self, prompts: list[list[int]], min_tokens: int = 16) -> None:
        """Run the prompts' longest common prefix once and keep it, so that different questions
        under one instruction prompt (an evaluation's first wave) prefill only what follows
        it: 260 test questions x 459 tokens would otherwise run the instructions 260 times."""
        shortest = min(prompts, key=len)
        n = len(shortest) - 1  # at least one token of each prompt is run, for its logits
        for p in prompts:
            while n and p[:n] != shortest[:n]:
                n = next(i for i in range(n) if p[i] != shortest[i])
        if n < min_tokens or self._longest_kept(tuple(shortest))[1] >= n:
            return
        cache = self._new_cache()
        ids = torch.tensor([shortest[:n]], device=self.device)
        self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.tokens_prefilled += n
        self._kept[tuple(shortest[:n])] = [(layer.keys[0], layer.values[0])
                                           for layer in cache.layers]
        self._kept_lengths = sorted({len(k) for k in self._kept}, reverse=True)

    def _new_cache(self):
        return new_cache(self.fast_path)

    def _longest_kept(self, prompt: tuple[int, ...]):
        """The kept entry whose key is the longest prefix of `prompt`, and how many of its
        tokens to reuse (at most len(prompt) - 1); (None, 0) when none is."""
        for n in self._kept_lengths:
            if n <= len(prompt) and (e := self._kept.get(prompt[:n])) is not None:
                return e, min(n, len(prompt) - 1)
        return None, 0

    def _keep_rows(self, cache, attn: torch.Tensor, finished: list[tuple[int, int]],
                   prompts: list[list[int]], toks: list[list[int]]) -> None:
        """Keep the keys and values of the rows that just finished (batch index i, original
        row r): the cache holds their prompt and every sampled token but the last."""
        if not self.prefix_cache_bytes:
            return
        for i, r in finished:
            valid = attn[i].bool()
            layers = [(layer.keys[i][:, valid], layer.values[i][:, valid])
                      for layer in cache.layers]
            size = sum(k.numel() * k.element_size() * 2 for k, _ in layers)
            if self._new_bytes + size > self.prefix_cache_bytes:
                return
            self._new_bytes += size
            self._new[tuple(prompts[r]) + tuple(toks[r][:-1])] = layers

    def _weights_version(self) -> tuple:
        # in-place updates (optimizer steps, load_state_dict) bump a tensor's version
        return tuple(p._version for p in self.model.parameters())

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
