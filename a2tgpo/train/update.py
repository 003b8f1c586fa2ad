"""The policy update of the recipe (rl.py step 8) and the log-probability passes it shares with
steps 5-6.

`update_policy` runs ppo_epochs x mini-batches (by prompt); `update_mini_batch` is one optimizer
update: each rank takes rows rank::world of the mini-batch, in micro-batches, and every loss
uses the mini-batch's global token/sequence counts with dp_size = world, so that the sum over
micro-batches and the average over ranks is exactly the unsplit mini-batch's loss
(`masks.aggregate_loss`). The same function runs in one process and under DeepSpeed ZeRO
(tests/train/ds_worker.py drives it on 2 ranks).

`update_logprobs` is log π_old through the update's own path (module, row grouping, length
cut, dtype; no gradients): the update's first forward then recomputes exactly those numbers,
so the first update's ratios are exactly 1 in bf16 too, where a pass that groups the rows
otherwise (other batch shapes and padding) differs by up to ~1e-2 per token.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from a2tgpo.algo.logprobs import DEFAULT_CHUNK_TOKENS, chunked_logprobs
from a2tgpo.algo.losses import entropy_aware_advantage, kl_penalty, policy_loss
from a2tgpo.algo.masks import aggregate_loss, local_denominators
from a2tgpo.algo.methods import LossConfig
from a2tgpo.rollout.trajectory import Batch
from a2tgpo.train.config import ScheduleConfig

# diagnostics of policy_loss averaged over micro-batches into loss/<key>
DIAGNOSTICS = ("pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "ppo_kl", "ratio_mean")


@dataclass
class UpdateBatch:
    """What the update reads; row b is trajectory b of `batch`.

    old_logp, adv: (B, L) log π_old of each token and its advantage (0 off loss tokens);
    ref_logp: (B, L) log π_ref, None without KL; clip_scale: (B, L) adaptive clip scale c
    (bounds 1 − c·ε_low, 1 + c·ε_high), None for fixed bounds.
    """

    batch: Batch
    old_logp: torch.Tensor
    adv: torch.Tensor
    ref_logp: torch.Tensor | None = None
    clip_scale: torch.Tensor | None = None


@dataclass
class UpdateLog:
    """What the updates of one step report: per micro-batch loss terms (each already / world,
    so the sum over ranks is the unsplit value), diagnostics, clip fractions by turn (over all
    updates, and over the updates after the step's first), and one gradient norm per update.

    The first update of a step is on-policy (π = π_old, every ratio exactly 1 when log π_old
    comes from `update_logprobs`), so nothing clips there whatever the bounds; only the later
    ones show whether the clip, and hence β, acts."""

    terms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    diagnostics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    clip_by_turn: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    clip_later: list[float] = field(default_factory=list)
    clip_by_turn_later: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    grad_norms: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """Per update: an update's micro-batch terms sum to its loss (global denominators)."""
        updates = max(1, len(self.grad_norms))
        out = {f"loss/{k}": float(v[0] / updates) for k, v in self.terms.items()}
        out.update({f"loss/{k}": float(np.mean(v)) for k, v in self.diagnostics.items()})
        out.update({f"clip/by_turn/{k}": float(np.mean(v)) for k, v in self.clip_by_turn.items()})
        if self.clip_later:
            out["clip/later"] = float(np.mean(self.clip_later))
        out.update({f"clip/later/by_turn/{k}": float(np.mean(v))
                    for k, v in self.clip_by_turn_later.items()})
        out["optim/grad_norm"] = float(np.mean(self.grad_norms)) if self.grad_norms else 0.0
        return out


def final_hidden(model, ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, *, share_prefix: bool = False) -> torch.Tensor:
    """The decoder's final (normed) hidden states, without the output layer. (b, L) -> (b, L, H).

    With gradients, through `model` itself (the DeepSpeed engine's forward prepares its
    gradient bookkeeping), keeping no logits (an empty `logits_to_keep`); without, through the
    decoder alone, so that the per-layer hidden states are not collected.

    share_prefix: the columns every row holds with the same ids (`common_prefix`: the system
    prompt and chat template) run once, and the rest of each row on their keys and values, so
    a micro-batch computes the prompt once instead of once per row (the same values and
    gradients up to round-off)."""
    c = common_prefix(ids, attention_mask) if share_prefix else 0
    if c < 1:
        return _hidden(model, ids, attention_mask, position_ids, None)
    b = ids.shape[0]
    cols = slice(0, c)
    head, cache = _hidden(model, ids[:1, cols], attention_mask[:1, cols], position_ids[:1, cols],
                          "new")
    cache.batch_repeat_interleave(b)  # every row attends to the same prefix keys/values
    tail = _hidden(model, ids[:, c:], attention_mask, position_ids[:, c:], cache)
    return torch.cat([head.expand(b, -1, -1), tail], dim=1)


def _hidden(model, ids, mask, pos, cache):
    """final_hidden's forward: cache None (no cache), "new" (returns the prefix's cache too)
    or a cache the ids continue (`mask` then covers its columns as well)."""
    from transformers import DynamicCache

    use = cache is not None
    past = DynamicCache() if cache == "new" else (cache if use else None)
    if torch.is_grad_enabled():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                    output_hidden_states=True, use_cache=use, past_key_values=past,
                    logits_to_keep=torch.zeros(0, dtype=torch.long, device=ids.device))
        hidden = out.hidden_states[-1]
    else:
        decoder = getattr(model, "module", model).get_decoder()
        hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=use,
                         past_key_values=past).last_hidden_state
    return (hidden, past) if cache == "new" else hidden


def common_prefix(ids_bL: torch.Tensor, mask_bL: torch.Tensor) -> int:
    """How many leading columns every row holds with the same ids, at most the shortest row's
    length − 1 (each row keeps a token of its own); 0 for fewer than two rows."""
    if ids_bL.shape[0] < 2:
        return 0
    same = (ids_bL == ids_bL[:1]).all(0) & mask_bL.bool().all(0)
    return min(int(same.long().cumprod(0).sum()), int(mask_bL.sum(1).min()) - 1)


def hidden_logprobs(hidden_bLH: torch.Tensor, ids_bL: torch.Tensor, project, *,
                    with_entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(x_t | x_<t) at every position t (0 at t = 0) from the final hidden states and the
    output layer `project`, in chunks of `chunk_tokens` (algo/logprobs.py): no (b, L, V) tensor.

    Shapes: hidden_bLH (b, L, H), ids_bL (b, L) -> logp_bL (b, L) and entropy_bL (b, L) (the
    entropy of the distribution that predicted token t) or None.
    """
    b, L = ids_bL.shape
    # the hidden size named: with L = 1 there are no tokens, and -1 would be ambiguous
    lp, ent = chunked_logprobs(
        hidden_NH=hidden_bLH[:, :-1].reshape(b * (L - 1), hidden_bLH.shape[-1]),
        project=project, target_N=ids_bL[:, 1:].reshape(-1), with_entropy=with_entropy,
        chunk_tokens=chunk_tokens)
    zero = torch.zeros(b, 1, dtype=lp.dtype, device=lp.device)
    lp = torch.cat([zero, lp.view(b, L - 1)], dim=1)
    if ent is None:
        return lp, None
    return lp, torch.cat([zero, ent.view(b, L - 1)], dim=1)


def row_inputs(batch: Batch, rows: slice | list[int], length: int | None, device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids) of `rows`, the first `length` columns (all: None)."""
    cols = slice(0, length)
    return tuple(x[rows][:, cols].to(device)
                 for x in (batch.input_ids, batch.attention_mask, batch.position_ids))


def token_logprobs(model, batch: Batch, rows: slice | list[int], *, with_entropy: bool = False,
                   device=None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                   length: int | None = None, share_prefix: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`hidden_logprobs` of the selected rows through `model` and its own output layer.
    `length`: only the first `length` columns (rows are right-padded).

    Shapes: -> logp_bL (b, L') and entropy_bL (b, L'), aligned with batch.input_ids[:, :L'],
    L' = length or L.
    """
    ids, mask, pos = row_inputs(batch, rows, length, device)
    return hidden_logprobs(final_hidden(model, ids, mask, pos, share_prefix=share_prefix), ids,
                           getattr(model, "module", model).get_output_embeddings(),
                           with_entropy=with_entropy, chunk_tokens=chunk_tokens)


def row_length(batch: Batch, rows: list[int]) -> int:
    """The longest row of `rows` in tokens (>= 1): columns past it hold only padding."""
    return max(1, int(batch.attention_mask[rows].sum(1).max())) if rows else 1


@torch.no_grad()
def update_logprobs(backend, batch: Batch, schedule: ScheduleConfig, *, seed: int
                    ) -> tuple[list[int], torch.Tensor]:
    """log π of every token through the path the update takes, without gradients: the same
    module (`backend.model`), the rows grouped as the first epoch's updates group them (the
    mini-batches of `mini_batch_rows` with `seed`, then this rank's `micro_batches` of each),
    every micro-batch cut to its longest row, the prompt shared as `schedule.share_prompt`
    says. The update's forward of a micro-batch then gets exactly these numbers (the same
    kernels on the same shapes), so log π − log π_old is exactly 0 before the first optimizer
    step, in bf16 as in fp32; a pass that groups the rows otherwise (other batch shapes and
    padded lengths, hence other matmul blocking and rounding) differs in bf16 by up to ~1e-2
    per token (gpu-path.md M3), which the turn clip (ε = 3e-3) would act on.

    With ppo_epochs > 1 the later epochs regroup the rows: their ratios carry that bf16
    grouping difference on top of the policy's change (in fp32, float noise only).

    Returns (the rows this rank computed, in no particular order; a (B, L) CPU float32 tensor
    holding them, 0 past each micro-batch's length and in the other ranks' rows)."""
    out = torch.zeros(batch.input_ids.shape)
    lengths = dict(enumerate(batch.attention_mask.sum(1).tolist()))
    mine: list[int] = []
    for rows in mini_batch_rows(batch.group_ids, schedule, seed)[0]:
        for mb in micro_batches(lengths, rows, backend.world_size,
                                max_rows=schedule.micro_batch_size,
                                max_tokens=schedule.micro_batch_tokens)[backend.rank]:
            if not mb:
                continue
            # as micro_batch_loss: the same rows, length and module
            n = row_length(batch, mb)
            out[mb, :n] = token_logprobs(backend.model, batch, mb, device=backend.device,
                                         length=n, share_prefix=schedule.share_prompt)[0].cpu()
            mine += mb
    return mine, out


@torch.no_grad()
def batched_logprobs(model, batch: Batch, rows: list[int], size: int, device, *,
                     max_tokens: int = 0, share_prefix: bool = False) -> torch.Tensor:
    """token_logprobs of `rows` (no gradients), in micro-batches of `size` rows or packed under
    `max_tokens` (`micro_batches` on one rank), each cut to its own longest row; on CPU.
    -> (len(rows), L), 0 past each micro-batch's length."""
    out = torch.zeros(len(rows), batch.input_ids.shape[1])
    where = {b: i for i, b in enumerate(rows)}
    lengths = dict(zip(rows, batch.attention_mask[rows].sum(1).tolist(), strict=True))
    for mb in micro_batches(lengths, rows, 1, max_rows=size, max_tokens=max_tokens)[0]:
        if mb:
            n = row_length(batch, mb)
            out[[where[b] for b in mb], :n] = token_logprobs(
                model, batch, mb, device=device, length=n, share_prefix=share_prefix)[0].cpu()
    return out


def micro_batch_loss(model, data: UpdateBatch, rows: list[int], mask_bL: torch.Tensor,
                     loss: LossConfig, *, tokens: float, seqs: float, world: int,
                     norm_length: int, device, share_prefix: bool = False
                     ) -> tuple[torch.Tensor, dict, dict]:
    """The loss of one micro-batch (its share of the mini-batch loss, times `world`): the
    clipped surrogate, + kl_coef·KL, − entropy_coef·H. Returns (loss, {"pg", "kl"} terms,
    policy_loss diagnostics)."""
    b = data.batch
    # right padding: columns past the micro-batch's longest row hold nothing of it
    n = row_length(b, rows)
    cut = lambda x: x[rows][:, :n].to(device)  # noqa: E731
    mask_bL = mask_bL[:, :n]
    agg = dict(global_tokens=tokens, global_seqs=seqs, dp_size=world, norm_length=norm_length)
    need_ent = loss.entropy_coef > 0 or loss.entropy_adv_alpha > 0
    logp, ent = token_logprobs(model, b, rows, with_entropy=need_ent, device=device, length=n,
                               share_prefix=share_prefix)
    adv = cut(data.adv)
    if loss.entropy_adv_alpha > 0:
        adv = entropy_aware_advantage(adv_BT=adv, entropy_BT=ent.detach(), mask_BT=mask_bL,
                                      alpha=loss.entropy_adv_alpha)
    pg, diag = policy_loss(
        logp_BT=logp, old_logp_BT=cut(data.old_logp), adv_BT=adv, mask_BT=mask_bL,
        ratio_level=loss.ratio_level, clip_low=loss.clip_low, clip_high=loss.clip_high,
        agg_mode=loss.agg_mode,
        clip_scale_BT=None if data.clip_scale is None else cut(data.clip_scale),
        dual_clip=loss.dual_clip, upper_clip=loss.upper_clip,
        turn_id_BT=cut(b.turn_id), K=b.turn_mask.shape[1], **agg)
    total, terms = pg, {"pg": pg}
    if data.ref_logp is not None:
        kl = kl_penalty(logp_BT=logp, ref_logp_BT=cut(data.ref_logp),
                        kind=loss.kl_kind)
        terms["kl"] = aggregate_loss(kl, mask_bL, loss.agg_mode, **agg)
        total = total + loss.kl_coef * terms["kl"]
    if loss.entropy_coef > 0:
        total = total - loss.entropy_coef * aggregate_loss(ent, mask_bL, loss.agg_mode, **agg)
    return total, terms, diag


def micro_batches(lengths: dict[int, int], rows: list[int], world: int, *, max_rows: int,
                  max_tokens: int = 0) -> list[list[list[int]]]:
    """Each rank's micro-batches of the mini-batch `rows` (per rank, a list of row lists; every
    rank gets the same number, some possibly empty, so ZeRO's collectives stay in step).

    max_tokens 0: rank r takes rows r::world in order, `max_rows` per micro-batch. Otherwise
    token-budget packing: rows sorted longest first are dealt to the ranks in turn (so ranks
    get similar lengths), and each rank packs its rows in that order into micro-batches whose
    padded size, rows x longest row, stays within `max_tokens` (a row longer than the budget
    goes alone). `lengths[b]` is row b's length in tokens (prompt included). Every rank
    computes the same plan from the same lengths: no communication.
    """
    if max_tokens <= 0:
        plan = [[rank_rows[i: i + max_rows] for i in range(0, len(rank_rows), max_rows)]
                for rank_rows in (rows[r::world] for r in range(world))]
    else:
        ordered = sorted(rows, key=lambda b: (-lengths[b], b))
        plan = []
        for r in range(world):
            mbs: list[list[int]] = []
            for b in ordered[r::world]:
                # longest first: the micro-batch's first row sets its padded length
                if mbs and (len(mbs[-1]) + 1) * lengths[mbs[-1][0]] <= max_tokens:
                    mbs[-1].append(b)
                else:
                    mbs.append([b])
            plan.append(mbs)
    n = max(1, max(len(p) for p in plan))
    return [p + [[] for _ in range(n - len(p))] for p in plan]


def update_mini_batch(backend, data: UpdateBatch, rows: list[int], loss: LossConfig, *,
                      micro_batch_size: int, norm_length: int, log: UpdateLog,
                      micro_batch_tokens: int = 0, share_prefix: bool = False) -> float:
    """One optimizer update on the mini-batch `rows` (every rank passes the same rows); returns
    the gradient norm. Micro-batches by `micro_batches`; every rank makes the same number of
    forward/backward calls (ZeRO's collectives): a rank short of rows runs a micro-batch whose
    loss mask is all zero."""
    world, device = backend.world_size, backend.device
    tokens, seqs = local_denominators(data.batch.loss_mask[rows])
    lengths = dict(zip(rows, data.batch.attention_mask[rows].sum(1).tolist(), strict=True))
    plan = micro_batches(lengths, rows, world, max_rows=micro_batch_size,
                         max_tokens=micro_batch_tokens)[backend.rank]
    for mb in plan:
        mask = data.batch.loss_mask[mb].to(device)
        if not mb:
            mb = rows[:1]
            mask = torch.zeros_like(data.batch.loss_mask[mb]).to(device)
        total, terms, diag = micro_batch_loss(backend.model, data, mb, mask, loss,
                                              tokens=tokens, seqs=seqs, world=world,
                                              norm_length=norm_length, device=device,
                                              share_prefix=share_prefix)
        backend.backward(total)
        # updates made before this one: from the second on, π has moved away from π_old
        _record(log, total, terms, diag, world, any_tokens=bool(mask.any()),
                later=bool(log.grad_norms))
    return backend.step()


def _record(log: UpdateLog, total, terms: dict, diag: dict, world: int, *, any_tokens: bool,
            later: bool = False) -> None:
    # each term carries the factor `world`: / world makes the sum over ranks the unsplit value
    log.terms["total"].append(float(total.detach()) / world)
    for k, v in terms.items():
        log.terms[k].append(float(v.detach()) / world)
    if not any_tokens:
        return
    for key in DIAGNOSTICS:
        if key in diag and torch.isfinite(torch.as_tensor(diag[key])):
            log.diagnostics[key].append(float(diag[key]))
    for k, v in diag.get("pg_clipfrac_by_turn", {}).items():
        log.clip_by_turn[int(k)].append(float(v))
        if later:
            log.clip_by_turn_later[int(k)].append(float(v))
    if later and "pg_clipfrac" in diag:
        log.clip_later.append(float(diag["pg_clipfrac"]))


def mini_batch_rows(group_ids: list, schedule: ScheduleConfig, seed: int
                    ) -> list[list[list[int]]]:
    """The rows of every optimizer update of a step, per epoch: each of the ppo_epochs
    shuffles the prompt groups (one `random.Random(seed)` across the epochs) and takes
    `mini_batch_prompts` groups per update, rows in batch order. The same on every rank."""
    groups = list(dict.fromkeys(group_ids))
    rng = random.Random(seed)
    epochs = []
    for _ in range(schedule.ppo_epochs):
        order = groups[:]
        rng.shuffle(order)
        epochs.append([])
        for m in range(0, len(order), schedule.mini_batch_prompts):
            chosen = set(order[m: m + schedule.mini_batch_prompts])
            epochs[-1].append([b for b, g in enumerate(group_ids) if g in chosen])
    return epochs


def update_policy(backend, scheduler, data: UpdateBatch, loss: LossConfig,
                  schedule: ScheduleConfig, *, seed: int, norm_length: int) -> UpdateLog:
    """ppo_epochs passes; each shuffles the prompt groups (seeded) and makes one optimizer
    update per `mini_batch_prompts` groups (`mini_batch_rows`). Loss terms are summed over
    ranks at the end."""
    log = UpdateLog()
    backend.unwrapped.train()
    for epoch in mini_batch_rows(data.batch.group_ids, schedule, seed):
        for rows in epoch:
            log.grad_norms.append(update_mini_batch(
                backend, data, rows, loss, micro_batch_size=schedule.micro_batch_size,
                micro_batch_tokens=schedule.micro_batch_tokens, norm_length=norm_length,
                share_prefix=schedule.share_prompt,
                log=log))
            scheduler.step()
    backend.unwrapped.eval()
    for key, vals in log.terms.items():
        log.terms[key] = [backend.all_reduce_sum(float(np.sum(vals)))]
    return log
