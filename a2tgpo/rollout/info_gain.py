"""Teacher-forced gold-answer log-probabilities at each probe point of a trajectory (IG input).

For trajectory b with probe points P_0 < P_1 < … (P_0 = prompt length, P_t = end of tool-call turn
t's observation), the value at point t is the mean log-probability of the gold answer's tokens
when a fixed probe (answer template around the gold answer, algorithms.md §5.1) is appended to
ids[:P_t]:

    values[b][t] = mean_{j in answer span} log π(probe_j | ids[:P_t], probe_<j)

Row b of `values` is row b of `gold_logprob_BK1` for `a2tgpo.algo.info_gain.information_gain`.

Everything is token ids: the trajectory is never re-tokenised (spec §13.1); the probe is
tokenised once on its own (`build_probe`) and appended as ids.

Two methods, equal up to float round-off:
  "kv" (default): one decoder forward over each batch of trajectories with a KV cache — the
    forward the trainer needs for old log-probs anyway, whose per-token log-probs are returned
    too ("fused", from the hidden states in chunks: no (B, L, V) logits) — then one more
    forward feeding, per trajectory, T copies of the probe against that cache, with a 4D mask
    that lets copy t see only the cached keys [0, P_t) and itself.
    Extra tokens: T·a per trajectory (a = probe length) versus Σ_t (P_t + a) for "naive"
    (performance.md §1.2–1.4). Why this variant:
      - a packed pass [traj ∥ probes] with a block mask also processes T·a extra tokens, but
        its mask is dense over L × L, so the trajectory part loses the causal fast path
        (≈1.7x a plain forward on CPU, §1.4); here the trajectory forward is a plain one;
      - cropping or copying the cache once per probe point (DynamicCache crop / batch repeat)
        moves T copies of the cache through memory per layer; on CPU that made IG cost ≈0.25
        of the plain forward in bench/info_gain.py, against ≈0.05 here, where the cache is
        appended to once.
  "naive": one full forward per prefix, ids[:P_t] + probe, as IGPO does; the oracle for tests
    and the benchmark.

Padding: batches are right-padded, position ids come from the attention mask (probe copies
continue from P_t), and pads are never attended (the A2TGPO code attends to left pads, spec
§13.7). "kv" needs the sdpa or eager attention (flash-attention takes no 4D mask) and full
attention in every layer (cutting at P_t needs every cached position).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch

from a2tgpo.algo.logprobs import chunked_logprobs
from a2tgpo.algo.methods import IGPO_TEMPLATE
from a2tgpo.model.fast_decode import ATTENTION


class Trajectory(NamedTuple):
    """One trajectory: `ids` (prompt + all turns) and its probe points (prefix lengths)."""

    ids: Sequence[int]
    probe_points: Sequence[int]


class Probe(NamedTuple):
    """Probe token ids and the [start, end) span of the gold-answer tokens inside them."""

    ids: Sequence[int]
    answer_span: tuple[int, int]


def build_probe(tokenizer, answer: str, template: str = IGPO_TEMPLATE) -> Probe:
    """Tokenise `template` with "{gt}" replaced by `answer` (the first golden answer).

    The answer span is every token whose character offsets overlap the answer's characters, so
    a token straddling the boundary counts (as IGPO does with return_offsets_mapping).
    """
    if template.count("{gt}") != 1:
        raise ValueError("template must contain '{gt}' exactly once")
    prefix, suffix = template.split("{gt}")
    lo, hi = len(prefix), len(prefix) + len(answer)
    enc = tokenizer(prefix + answer + suffix, add_special_tokens=False,
                    return_offsets_mapping=True)
    inside = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s < hi and e > lo]
    if not inside:
        raise ValueError(f"answer {answer!r} has no tokens")
    probe = Probe(list(enc["input_ids"]), (inside[0], inside[-1] + 1))
    _check_probe(probe)
    return probe


def gold_logprob_matrix(values: Sequence[Sequence[float]]) -> torch.Tensor:
    """`values` as the (B, K+1) float tensor `information_gain` takes; missing points are NaN.

    K+1 = the most probe points of any trajectory (at least 1)."""
    width = max([len(v) for v in values] + [1])
    out = torch.full((len(values), width), float("nan"))
    for b, v in enumerate(values):
        out[b, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


def score_gold_logprobs(
    model,
    trajectories: Sequence[tuple[Sequence[int], Sequence[int]]],
    probes: Sequence[tuple[Sequence[int], tuple[int, int]]],
    *,
    method: Literal["kv", "naive"] = "kv",
    batch_size: int = 8,
    token_logprobs: bool = True,
) -> tuple[list[list[float]], list[list[float]] | None, dict]:
    """Mean gold-answer log-prob at every probe point of every trajectory.

    Args:
      model: a Hugging Face causal LM (full attention), used as is (call under eval mode).
      trajectories: B items (ids, probe_points), read as `Trajectory`; 1 <= P_t <= len(ids).
        A trajectory without tool calls has the single point [prompt length].
      probes: B items (probe_ids, (start, end)), read as `Probe` (see `build_probe`); the
        answer span must not start at 0, so its first token is predicted inside the probe.
      method: "kv" (cache reuse, default) or "naive" (one forward per prefix).
      batch_size: trajectories per forward ("kv": each batch is one trajectory forward and
        one probe forward), or prefix+probe sequences per forward ("naive").
      token_logprobs: with "kv", also return the trajectory's per-token log-probs from the same
        forward (the old-logprob pass). Ignored by "naive", which does not run that forward.

    Returns:
      values: values[b][t] = mean log π of probe b's answer tokens after ids_b[:P_t]
        (len = len(probe_points_b)).
      token_logprobs: per b, log π(ids_b[j+1] | ids_b[:j+1]) for j = 0..L_b−2 (len L_b − 1),
        or None ("naive", or token_logprobs=False).
      stats: tokens counted without pads — trajectory_tokens Σ L_b; ig_tokens, the tokens run
        for IG only (kv: Σ_b T_b·a_b; naive: Σ_b Σ_t (P_t + a_b)); tokens_processed, all tokens
        run (kv: trajectory + IG; naive: IG); padded_tokens, the same with pads (tensor sizes);
        probe_points Σ_b T_b; forwards, model calls.
    """
    trajs = [Trajectory(list(ids), list(points)) for ids, points in trajectories]
    probe_list = [Probe(list(ids), (int(span[0]), int(span[1]))) for ids, span in probes]
    if len(trajs) != len(probe_list):
        raise ValueError(f"{len(trajs)} trajectories but {len(probe_list)} probes")
    for traj in trajs:
        if any(not 1 <= p <= len(traj.ids) for p in traj.probe_points):
            raise ValueError(f"probe points {traj.probe_points} outside 1..{len(traj.ids)}")
    for probe in probe_list:
        _check_probe(probe)
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    stats = dict(trajectory_tokens=sum(len(t.ids) for t in trajs), ig_tokens=0,
                 tokens_processed=0, padded_tokens=0,
                 probe_points=sum(len(t.probe_points) for t in trajs), forwards=0)
    with torch.inference_mode():
        if method == "kv":
            values, lps = _score_kv(model, trajs, probe_list, batch_size, token_logprobs, stats)
        elif method == "naive":
            values, lps = _score_naive(model, trajs, probe_list, batch_size, stats), None
        else:
            raise ValueError(f"method must be 'kv' or 'naive', got {method!r}")
    return values, lps, stats


def _check_probe(probe: Probe) -> None:
    start, end = probe.answer_span
    if not 1 <= start < end <= len(probe.ids):
        raise ValueError(f"answer span {probe.answer_span} must satisfy 1 <= start < end <= "
                         f"{len(probe.ids)} (the template needs text before the answer)")


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _pad(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (ids, mask), both (N, max len). Pad id 0: masked, so never attended to.

    Right padding, because a left pad's query row would have no key to attend to."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids.to(device), mask.to(device)


def _positions(mask_NL: torch.Tensor) -> torch.Tensor:
    """Position ids (N, L) counting real tokens only; pads get 0 (their outputs are unused)."""
    return (mask_NL.cumsum(-1) - 1).clamp(min=0)


def _mean_answer_logprob(logits_NKV: torch.Tensor,
                         items: list[tuple[int, list[int], list[int]]]) -> list[float]:
    """Per item (n, cols, targets): mean over j of log_softmax(logits[n, cols[j]])[targets[j]]."""
    logp = logits_NKV.float().log_softmax(-1)
    return [logp[n, cols, targets].mean().item() for n, cols, targets in items]


def _clock(device) -> float:
    """Wall time after the device's queued work is done (the GPU runs asynchronously)."""
    import time

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _score_kv(model, trajs, probes, batch_size, want_lps, stats):
    from transformers import DynamicCache

    if model.config._attn_implementation not in ("sdpa", ATTENTION, "eager"):
        raise ValueError("method 'kv' needs the sdpa or eager attention (it passes a 4D mask); "
                         f"got {model.config._attn_implementation!r}")
    device = _device(model)
    values: list[list[float]] = [[float("nan")] * len(t.probe_points) for t in trajs]
    lps: list[list[float]] | None = [[] for _ in trajs] if want_lps else None
    # longest first, so each batch holds similar lengths (less padding)
    order = sorted(range(len(trajs)), key=lambda b: -len(trajs[b].ids))
    for lo in range(0, len(order), batch_size):
        chunk = order[lo: lo + batch_size]
        ids_BL, mask_BL = _pad([trajs[b].ids for b in chunk], device)
        cache = DynamicCache(config=model.config)
        t0 = _clock(device)
        # the decoder alone: its hidden states fill the cache and give the token log-probs in
        # chunks, without a (B, L, V) logits tensor (16 x 6.5k x 151,936 fp32 ~ 63 GB)
        hidden_BLH = model.get_decoder()(
            input_ids=ids_BL, attention_mask=mask_BL, position_ids=_positions(mask_BL),
            past_key_values=cache, use_cache=True).last_hidden_state
        t1 = _clock(device)
        stats["seconds_trajectory_forward"] = stats.get("seconds_trajectory_forward", 0) + t1 - t0
        stats["forwards"] += 1
        stats["tokens_processed"] += sum(len(trajs[b].ids) for b in chunk)
        stats["padded_tokens"] += ids_BL.numel()
        if any(cache.is_sliding):
            raise ValueError("KV reuse needs full attention in every layer (no sliding window)")
        if lps is not None:
            B, L = ids_BL.shape
            logp_N, _ = chunked_logprobs(
                hidden_NH=hidden_BLH[:, :-1].reshape(B * (L - 1), -1),
                project=model.get_output_embeddings(), target_N=ids_BL[:, 1:].reshape(-1))
            logp_BL = logp_N.view(B, L - 1)
            for row, b in enumerate(chunk):
                lps[b] = logp_BL[row, : len(trajs[b].ids) - 1].tolist()
        del hidden_BLH
        t2 = _clock(device)
        stats["seconds_token_logprobs"] = stats.get("seconds_token_logprobs", 0) + t2 - t1
        if any(trajs[b].probe_points for b in chunk):
            _probe_against_cache(model, cache, [trajs[b] for b in chunk],
                                 [probes[b] for b in chunk], [values[b] for b in chunk], stats)
        stats["seconds_probes"] = stats.get("seconds_probes", 0) + _clock(device) - t2
    return values, lps


def _probe_against_cache(model, cache, trajs, probes, values, stats):
    """One forward of every probe copy of the batch against the trajectories' cache.

    Row b's input is T_b copies of its probe back to back (T_b·a_b tokens, right-padded to Q);
    a 4D mask lets copy t see cached keys [0, P_t) and itself causally, nothing else, and its
    positions continue from P_t. The cache is neither copied nor cut, so the extra work is the
    T·a probe tokens (plus their attention over the cached keys). Fills `values[b][t]`.
    """
    device = _device(model)
    rows, copy, limit, pos = [], [], [], []  # per row: ids; per token: copy id, P_t, position
    for traj, probe in zip(trajs, probes, strict=True):
        a = len(probe.ids)
        rows.append(list(probe.ids) * len(traj.probe_points))
        copy.append([t for t in range(len(traj.probe_points)) for _ in range(a)])
        limit.append([p for p in traj.probe_points for _ in range(a)])
        pos.append([p + j for p in traj.probe_points for j in range(a)])
    width = max(map(len, rows))
    ids_BQ, real_BQ = _pad(rows, device)
    # pads: copy −1 (they see only earlier pads, so no query row is empty, which would give NaN
    # activations that then leak through zero attention weights), key limit 0, position 0
    copy_BQ = torch.tensor([c + [-1] * (width - len(c)) for c in copy], device=device)
    limit_BQ = torch.tensor([c + [0] * (width - len(c)) for c in limit], device=device)
    pos_BQ = torch.tensor([c + [0] * (width - len(c)) for c in pos], device=device)
    q = torch.arange(width, device=device)
    own = (copy_BQ[:, :, None] == copy_BQ[:, None, :]) & (q[None, :] <= q[:, None])[None]
    keys = torch.arange(cache.get_seq_length(), device=device)
    cached = keys[None, None, :] < limit_BQ[..., None]
    mask = torch.cat([cached, own], dim=-1)[:, None]  # (B, 1, Q, L + Q), True = attend
    if model.config._attn_implementation == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, dtype=model.dtype, device=device).masked_fill(
            ~mask, torch.finfo(model.dtype).min)
    # only the columns that predict answer tokens need logits: start−1 .. end−2 of each copy
    items = [(row, t, [t * len(probe.ids) + j for j in range(probe.answer_span[0] - 1,
                                                              probe.answer_span[1] - 1)])
             for row, (traj, probe) in enumerate(zip(trajs, probes, strict=True))
             for t in range(len(traj.probe_points))]
    keep = sorted({c for _, _, cols in items for c in cols})
    where = {c: i for i, c in enumerate(keep)}
    out = model(input_ids=ids_BQ, attention_mask=mask, position_ids=pos_BQ,
                past_key_values=cache, use_cache=True,
                logits_to_keep=torch.tensor(keep, device=device))
    stats["forwards"] += 1
    n_probe = int(real_BQ.sum())
    stats["ig_tokens"] += n_probe
    stats["tokens_processed"] += n_probe
    stats["padded_tokens"] += ids_BQ.numel()
    means = _mean_answer_logprob(
        out.logits,
        [(row, [where[c] for c in cols], [rows[row][c + 1] for c in cols])
         for row, _, cols in items])
    for (row, t, _), v in zip(items, means, strict=True):
        values[row][t] = v


def _score_naive(model, trajs, probes, batch_size, stats):
    device = _device(model)
    values: list[list[float]] = [[float("nan")] * len(t.probe_points) for t in trajs]
    seqs = sorted(((b, t, p) for b, traj in enumerate(trajs)
                   for t, p in enumerate(traj.probe_points)),
                  key=lambda x: -(x[2] + len(probes[x[0]].ids)))
    for lo in range(0, len(seqs), batch_size):
        sub = seqs[lo: lo + batch_size]
        rows = [list(trajs[b].ids[:p]) + list(probes[b].ids) for b, _, p in sub]
        ids_NL, mask_NL = _pad(rows, device)
        # logits only at the columns predicting answer tokens (P + start − 1 .. P + end − 2)
        items = [(n, [p + j for j in range(probes[b].answer_span[0] - 1,
                                           probes[b].answer_span[1] - 1)])
                 for n, (b, _, p) in enumerate(sub)]
        keep = sorted({c for _, cols in items for c in cols})
        where = {c: i for i, c in enumerate(keep)}
        out = model(input_ids=ids_NL, attention_mask=mask_NL, position_ids=_positions(mask_NL),
                    use_cache=False, logits_to_keep=torch.tensor(keep, device=device))
        stats["forwards"] += 1
        tokens = sum(len(r) for r in rows)
        stats["ig_tokens"] += tokens
        stats["tokens_processed"] += tokens
        stats["padded_tokens"] += ids_NL.numel()
        means = _mean_answer_logprob(
            out.logits,
            [(n, [where[c] for c in cols], [rows[n][c + 1] for c in cols]) for n, cols in items])
        for (b, t, _), v in zip(sub, means, strict=True):
            values[b][t] = v
    return values
