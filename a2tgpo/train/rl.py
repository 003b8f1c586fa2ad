"""The RL training recipe: one readable loop for every method of config/methods/.

Per step (numbered as in the loop below):
  1. sample prompts (seeded, resumable data order)
  2. roll out: chains, Tree-GRPO trees, AT2PO trees or AEPO branching, per the method
  3. rewards (the one reward implementation), DAPO overlong shaping
  4. DAPO dynamic sampling: drop groups without reward spread, refill (bounded)
  5. information gain (IGPO family) and old log-probs in one fused forward; reference
     log-probs when KL is on
  6. advantages per turn (a2tgpo.algo.turn_advantages), broadcast to tokens by turn id
  7. ppo_epochs x mini-batches x micro-batches, losses with the mini-batch's global
     denominators, one optimizer update per mini-batch
  8. weights to the rollout engine; validation, checkpoint and logging on schedule

Nothing here is method-specific beyond reading the method's settings.
"""

from __future__ import annotations

import copy
import logging
import math
import random
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

from a2tgpo.algo import turn_advantages
from a2tgpo.algo.advantages import dynamic_sampling_keep, overlong_penalty
from a2tgpo.algo.info_gain import information_gain
from a2tgpo.algo.losses import entropy_aware_advantage, kl_penalty, policy_loss
from a2tgpo.algo.masks import aggregate_loss, gather_turns, local_denominators
from a2tgpo.algo.rewards import score_response
from a2tgpo.config import dump_config, to_dict
from a2tgpo.grid import format_value
from a2tgpo.rollout.agent import Question, SearchTool, rollout_chains
from a2tgpo.rollout.trajectory import Batch, Trajectory, collate
from a2tgpo.train.config import TrainConfig

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# building blocks


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_questions(path: str | Path, limit: int = 0) -> list[Question]:
    from a2tgpo.data.qa import load_split

    rows = load_split(path)
    if limit:
        rows = rows[:limit]
    return [Question(r["id"], r["question"], tuple(r["golden_answers"])) for r in rows]


def token_logprobs(model, batch: Batch, rows: slice | list[int], *, with_entropy: bool = False,
                   device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(x_t | x_<t) at every position t (0 at t = 0) for the selected rows.

    Shapes: -> logp_BT (b, L) and entropy_BT (b, L) (entropy of the distribution that
    predicted token t), aligned with batch.input_ids.
    """
    ids = batch.input_ids[rows].to(device)
    attn = batch.attention_mask[rows].to(device)
    pos = batch.position_ids[rows].to(device)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float()
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)  # (b, L-1, V)
    lp = logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    ent = None
    if with_entropy:
        e = -(logp_all.exp() * logp_all).sum(-1)
        ent = torch.cat([torch.zeros_like(e[:, :1]), e], dim=1)
    return lp, ent


def score(cfg: TrainConfig, tok, trajs: list[Trajectory], *, training: bool
          ) -> list[Trajectory]:
    """Rewards and metrics for each trajectory (reward style of the method)."""
    from dataclasses import replace

    style = "search_r1" if cfg.method.reward.startswith("search_r1") else "a2tgpo"
    out = []
    for t in trajs:
        s = score_response(tok.decode(t.response_ids(), skip_special_tokens=True), list(t.golden_answers), style,
                           training=training)
        reward = s.reward
        if cfg.method.reward == "search_r1" and training:
            reward = s.em  # plain EM, no format reward
        out.append(replace(t, reward=reward, extra={**t.extra, "em": s.em, "f1": s.f1,
                                                   "format_ok": s.format_ok}))
    return out


def rollout(cfg: TrainConfig, questions: list[Question], engine, tool: SearchTool, *,
            seed: int, greedy: bool = False) -> list[Trajectory]:
    """The method's rollout shape over `questions` (greedy validation is always chains)."""
    from a2tgpo.model.backbone import chat_template_kwargs

    shape = cfg.method.rollout
    chat = chat_template_kwargs(cfg.backbone)
    if greedy or shape.shape == "chains":
        n = 1 if greedy else shape.n
        return rollout_chains(questions, n, engine, tool, cfg.rollout, seed=seed, greedy=greedy,
                              chat_kwargs=chat)
    from a2tgpo.rollout import trees

    fn = {"tree_random": trees.rollout_tree_grpo, "tree_entropy": trees.rollout_at2po,
          "aepo": trees.rollout_aepo}[shape.shape]
    return fn(questions, engine, tool, cfg.rollout, shape, seed=seed, chat_kwargs=chat)


def information_gains(cfg: TrainConfig, model, tok, trajs: list[Trajectory], device
                      ) -> tuple[list[list[float | None]], list[list[float]], dict]:
    """Per-trajectory IG per turn (None where absent) and the fused old-logprobs."""
    from a2tgpo.rollout.info_gain import build_probe, gold_logprob_matrix, score_gold_logprobs

    probes = [build_probe(tok, t.golden_answers[0]) for t in trajs]
    values, lps, stats = score_gold_logprobs(
        model, [(t.token_ids(), t.probe_points()) for t in trajs], probes, method="kv",
        batch_size=cfg.ig_batch_size, token_logprobs=True)
    ig, mask = information_gain(
        gold_logprob_BK1=gold_logprob_matrix(values),
        num_tool_calls_B=torch.tensor([t.num_tool_calls for t in trajs]),
        value=cfg.method.info_gain.value, first_turn=cfg.method.info_gain.first_turn)
    per_turn = []
    for b, t in enumerate(trajs):
        igs, c = [], 0  # IG of the c-th tool call goes to that turn; other turns get none
        for turn in t.turns[:-1]:
            if turn.stop == "search":
                igs.append(float(ig[b, c]) if bool(mask[b, c]) else None)
                c += 1
            else:
                igs.append(None)
        per_turn.append(igs)
    return per_turn, lps, stats


def advantage_inputs(tok, trajs: list[Trajectory], igs) -> list[dict]:
    """The framework-agnostic dicts `turn_advantages` takes."""
    out = []
    for b, t in enumerate(trajs):
        d = {"group": t.group_id, "reward": float(t.reward), "num_turns": len(t.turns)}
        if igs is not None:
            d["info_gain"] = igs[b]
        # GiGPO anchors: the question, then each turn's latest observation
        d["anchors"] = [t.question_id] + [tok.decode(list(turn.obs_ids))
                                          for turn in t.turns[:-1]]
        if t.tree is not None:
            d.update(tree=t.tree.tree, nodes=list(t.tree.nodes),
                     entropies=list(t.tree.entropies))
        out.append(d)
    return out


def per_turn_tensor(values: list[list[float]], K: int, fill: float) -> torch.Tensor:
    out = torch.full((len(values), K), fill, dtype=torch.float32)
    for b, v in enumerate(values):
        out[b, : len(v)] = torch.tensor(v, dtype=torch.float32)
    return out


# --------------------------------------------------------------------------------------------
# the loop


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) one training job; returns the final summary.

    Under `backend: deepspeed` every rank runs this function (started by the `deepspeed`
    launcher or srun): each rank rolls out and scores its share of the step's questions, the
    trajectories are gathered so every rank holds the whole batch in the same order, and each
    update splits the mini-batch's rows over the ranks with the mini-batch's global counts
    (see a2tgpo/train/distributed.py). Rank 0 alone writes the run folder and tracks.
    """
    from a2tgpo.model.backbone import load_model, load_tokenizer
    from a2tgpo.retrieval.retriever import build_retriever
    from a2tgpo.tracking import Tracker
    from a2tgpo.train.checkpoint import (
        EXIT_PREEMPTED,
        DataOrder,
        PreemptionHandler,
        latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )

    run_dir = Path(cfg.run_dir)
    distributed = cfg.backend == "deepspeed"
    if distributed:
        from a2tgpo.train.distributed import init_distributed

        info = init_distributed()
        rank, device = info.rank, str(info.device)
        if cfg.zero_stage == 3:
            raise ValueError(
                f"{run_dir / 'config.yaml'}: zero_stage 3 is not supported by the RL loop: ZeRO-3 "
                "shards the parameters, so each rank's rollouts and log-prob passes would need "
                "lockstep forwards on every rank; use zero_stage 1 or 2")
    else:
        rank = 0
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available()
                                                          else "cpu")
    main = rank == 0
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(cfg, run_dir / "config.yaml")
    seed_everything(cfg.seed)
    tok = load_tokenizer(cfg.backbone)
    model = load_model(cfg.backbone, device)
    method, sched = cfg.method, cfg.schedule
    ref_model = None
    if method.loss.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval()
        for p in ref_model.parameters():
            p.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    warm = max(1, cfg.optim.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / warm))
    train_qs = load_questions(cfg.train_file)
    dev_qs = load_questions(cfg.dev_file, sched.eval_questions)
    gen_mult = method.dapo.gen_batch_multiplier if method.dapo.dynamic_sampling else 1
    epochs = math.ceil(sched.steps * sched.prompts_per_step * gen_mult
                       * max(1, method.dapo.max_num_gen_batches if gen_mult > 1 else 1)
                       / max(1, len(train_qs))) + 1
    order = DataOrder(len(train_qs), seed=cfg.seed, epochs=epochs)
    retriever = build_retriever(cfg.retrieval, cfg.corpus, cfg.index)
    tool = SearchTool(retriever, tok, cfg.rollout)

    start, best = 0, {"step": None, "val_em": -1.0}
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        # weights (and, single process, the optimizer) before the backend wraps them
        state = load_checkpoint(ckpt, model=model,
                                optimizer=None if distributed else optimizer,
                                scheduler=scheduler)
        start, best = state["step"], state["best"]
        order.load_state_dict(state["data_order"])
        log.info("resumed from %s (step %d)", ckpt, start)
    backend = _make_backend(cfg, model, optimizer)
    if ckpt is not None and distributed:
        backend.load_state(ckpt / "backend")
    engine = make_engine(cfg, backend.unwrapped, tok)

    tags = {"method": method.id, "backbone": cfg.backbone.id, "seed": str(cfg.seed),
            "beta": format_value(method.advantage.beta),
            "gamma": format_value(method.advantage.gamma),
            "cell": cfg.cell, "stage": "train"}
    if main:
        tracker = Tracker(run_dir, cfg.tracking, study=cfg.study, run_name=cfg.cell or method.id,
                          tags=tags, params=_flat(to_dict(cfg)),
                          config_file=run_dir / "config.yaml", results_dir=cfg.results_dir)
    else:
        tracker = _NoTracker()
    summary: dict = {}
    with tracker, PreemptionHandler() as preempt:

        def validate(step: int) -> dict:
            """Greedy dev rollouts; the metrics go into the step's one metrics.jsonl row."""
            backend.unwrapped.eval()
            t0 = time.perf_counter()
            mine = dev_qs[backend.rank::backend.world_size]
            trajs = score(cfg, tok, rollout(cfg, mine, engine, tool, seed=VALIDATION_SEED,
                                            greedy=True), training=False)
            trajs = _gather(backend, trajs)
            em = float(np.mean([t.extra["em"] for t in trajs])) if trajs else 0.0
            metrics = {"val/em": em,
                       "val/f1": float(np.mean([t.extra["f1"] for t in trajs])),
                       "val/format_ok": float(np.mean([t.extra["format_ok"] for t in trajs])),
                       "val/tool_calls": float(np.mean([t.num_tool_calls for t in trajs])),
                       "val/seconds": time.perf_counter() - t0}
            # the best trained checkpoint (selection never reports step 0 of a trained
            # method), kept from pruning
            if em > best["val_em"] and (step > 0 or not method.train):
                best.update(step=step, val_em=em)
            if main:
                log.info("step %d validation: EM %.3f on %d dev questions", step, em,
                         len(trajs))
            return metrics

        def checkpoint(step: int) -> None:
            def backend_state(tmp: Path | None) -> None:
                # every rank writes its optimizer shard into the directory rank 0 is building
                where = backend.broadcast_object(str(tmp) if tmp is not None else None)
                backend.save_state(Path(where) / "backend")
                backend.barrier()

            if not main:
                backend_state(None)
                return
            keep = {best["step"]} if best["step"] is not None else set()
            save_checkpoint(run_dir, step, model=backend.unwrapped, tokenizer=tok,
                            optimizer=None if distributed else optimizer,
                            scheduler=scheduler, keep_last=sched.keep_last, keep_steps=keep,
                            trainer_state={"step": step, "best": dict(best),
                                           "data_order": order.state_dict()},
                            extra_state=backend_state if distributed else None)

        if start == 0:
            tracker.log(validate(0), 0)
            checkpoint(0)
        if not method.train:  # ReAct: evaluation of the starting policy only
            start = sched.steps
        from tqdm import tqdm

        bar = tqdm(range(start, sched.steps), desc=f"{method.id} seed {cfg.seed}", unit="step",
                   initial=start, total=sched.steps, disable=not main)
        for step in bar:
            metrics, sample = _train_step(cfg, step, backend, ref_model, tok, scheduler, engine,
                                          tool, train_qs, order)
            done = step + 1
            if done % sched.eval_every == 0 or done == sched.steps:
                metrics.update(validate(done))
            tracker.log(metrics, done)
            if main and (step == 0 or done % sched.eval_every == 0 or done == sched.steps):
                _write_rollouts(run_dir / ROLLOUTS_FILE, done, sample)
            bar.set_postfix(reward=f"{metrics['train/reward']:.2f}",
                            em=f"{metrics['train/em']:.2f}")
            if main:
                log.info("step %d: reward %.3f EM %.3f loss %.4f calls %.2f (%.1f s)", done,
                         metrics["train/reward"], metrics["train/em"], metrics["loss/total"],
                         metrics["rollout/tool_calls"], metrics["time/step"])
            stop = backend.all_reduce_sum(float(preempt.requested)) > 0
            if done % sched.save_every == 0 or done == sched.steps or stop:
                checkpoint(done)
            if stop:
                log.warning("preemption requested: saved step %d, exiting", done)
                backend.close()
                raise SystemExit(EXIT_PREEMPTED)
        summary = {"steps": sched.steps, "best_step": best["step"], "best_val_em": best["val_em"]}
        tracker.summary(summary)
    backend.close()
    return summary


ROLLOUTS_FILE = "rollouts.jsonl"
# the seed of greedy validation and evaluation rollouts (greedy decoding draws nothing from it;
# one constant keeps validation and test evaluation the same computation)
VALIDATION_SEED = 10_000_019


def _write_config(cfg: TrainConfig, path: Path) -> None:
    """The resolved config beside the results; left untouched when it already says the same
    (the DAG's cell config is this file, and rewriting it would look like a new input)."""
    from a2tgpo.config import dump_yaml

    text = dump_yaml(to_dict(cfg))
    if not path.exists() or path.read_text() != text:
        dump_config(cfg, path)


class _NoTracker:
    """What ranks other than 0 log to: nothing (rank 0 logs the gathered batch)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def log(self, metrics, step) -> None:
        pass

    def summary(self, metrics) -> None:
        pass


def _make_backend(cfg: TrainConfig, model, optimizer):
    from a2tgpo.train.distributed import DeepSpeedBackend, SingleBackend

    if cfg.backend == "single":
        return SingleBackend(model, optimizer, cfg.optim.grad_clip)
    return DeepSpeedBackend(model, optimizer, zero_stage=cfg.zero_stage,
                            grad_clip=cfg.optim.grad_clip,
                            micro_batch_size=cfg.schedule.micro_batch_size)


def _write_rollouts(path: Path, step: int, trajs: list[dict]) -> None:
    """Append one step's sampled trajectories (turn texts and queries) for the similarity
    and tool-call plots; one JSON line per trajectory."""
    import json

    with open(path, "a") as f:
        for t in trajs:
            f.write(json.dumps({"step": step, **t}) + "\n")


def make_engine(cfg: TrainConfig, model, tok):
    if cfg.engine == "hf":
        from a2tgpo.rollout.hf_engine import HfEngine

        return HfEngine(model, tok)
    from a2tgpo.rollout.vllm_engine import VllmEngine

    return VllmEngine(cfg.backbone.path, max_model_len=cfg.backbone.max_model_len,
                      seed=cfg.seed)


def _batched_logprobs(model, batch: Batch, rows: list[int], size: int, device) -> torch.Tensor:
    """token_logprobs of `rows` in micro-batches of `size`. -> (len(rows), L)"""
    if not rows:
        return torch.zeros(0, batch.input_ids.shape[1])
    return torch.cat([token_logprobs(model, batch, rows[s: s + size], device=device)[0].cpu()
                      for s in range(0, len(rows), size)])


def _gather_rows(backend, x: torch.Tensor, mine: list[int]) -> torch.Tensor:
    """Rows `mine` of x come from this rank; after the gather every rank has all rows."""
    if backend.world_size == 1:
        return x
    out = x.clone()
    for rows, vals in backend.all_gather_object((mine, x[mine])):
        out[rows] = vals
    return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _gather(backend, items: list) -> list:
    """Concatenate every rank's list, in rank order (the same list on every rank)."""
    return [x for part in backend.all_gather_object(items) for x in part]


def _train_step(cfg, step, backend, ref_model, tok, scheduler, engine, tool, train_qs,
                order) -> tuple[dict, list[dict]]:
    method, sched = cfg.method, cfg.schedule
    model, device = backend.unwrapped, backend.device
    rank, world = backend.rank, backend.world_size
    timings: dict[str, float] = defaultdict(float)
    tic = time.perf_counter()
    seed = cfg.seed * 1_000_003 + step

    # 1-4. prompts, rollouts (each rank its share of the questions), rewards, dynamic sampling
    model.eval()
    kept: list[Trajectory] = []
    gen_batches = 0
    want = sched.prompts_per_step
    calls_before, retrieval_before = tool.calls, tool.seconds
    while True:
        gen_batches += 1
        n_prompts = want * (method.dapo.gen_batch_multiplier
                            if method.dapo.dynamic_sampling else 1)
        # every rank draws the same questions (same data order), then keeps its share
        qs = [train_qs[i] for i in order.next_batch(n_prompts)][rank::world]
        t0 = time.perf_counter()
        trajs = rollout(cfg, qs, engine, tool, seed=seed + 7919 * gen_batches + 104_729 * rank)
        timings["rollout"] += time.perf_counter() - t0
        trajs = score(cfg, tok, trajs, training=True)
        if method.dapo.overlong_buffer:
            pen = overlong_penalty(
                length_B=torch.tensor([t.response_length() for t in trajs]),
                max_length=cfg.rollout.max_response_tokens,
                buffer_length=method.dapo.overlong_buffer,
                penalty_factor=method.dapo.overlong_factor)
            from dataclasses import replace

            trajs = [replace(t, reward=t.reward + float(p)) for t, p in zip(trajs, pen)]
        trajs = _gather(backend, trajs)
        if not method.dapo.dynamic_sampling:
            kept = trajs
            break
        keep = dynamic_sampling_keep(metric_B=torch.tensor([t.reward for t in trajs]),
                                     group_B=[t.group_id for t in trajs])
        kept += [t for t, k in zip(trajs, keep.tolist()) if k]
        if len({t.group_id for t in kept}) >= want:
            groups = list(dict.fromkeys(t.group_id for t in kept))[:want]
            kept = [t for t in kept if t.group_id in set(groups)]
            break
        if gen_batches >= method.dapo.max_num_gen_batches > 0:
            raise RuntimeError(
                f"DAPO dynamic sampling: only {len({t.group_id for t in kept})} of {want} "
                f"groups with reward spread after {gen_batches} generation batches "
                "(dapo.max_num_gen_batches); the policy's rewards are nearly constant")
    trajs = kept
    retrieval_calls = int(backend.all_reduce_sum(float(tool.calls - calls_before)))
    # retrieval happens inside the rollout: reported on its own, and taken out of "rollout"
    timings["retrieval"] = tool.seconds - retrieval_before
    timings["rollout"] -= timings["retrieval"]

    # 5. information gain + old log-probs (one fused forward), reference log-probs: each rank
    # scores rows rank::world, then the rows are gathered back into batch order
    batch = collate(trajs, tok.pad_token_id)
    B, L = batch.input_ids.shape
    mine = list(range(rank, B, world))
    igs = None
    t0 = time.perf_counter()
    ig_stats = {}
    old = torch.zeros(B, L)
    if method.info_gain.enabled:
        my_igs, fused, my_stats = information_gains(cfg, model, tok, [trajs[b] for b in mine],
                                                    device)
        igs = [None] * B
        parts = backend.all_gather_object((mine, my_igs, fused, my_stats))
        ig_stats = defaultdict(float)
        for rows, part_igs, part_lps, part_stats in parts:
            for b, ig_b, lp in zip(rows, part_igs, part_lps):
                igs[b] = ig_b
                old[b, 1: 1 + len(lp)] = torch.tensor(lp)
            for k, v in part_stats.items():
                ig_stats[k] += v
        timings["info_gain+old_logprob"] = time.perf_counter() - t0
    else:
        with torch.no_grad():
            old[mine] = _batched_logprobs(model, batch, mine, sched.micro_batch_size, device)
        old = _gather_rows(backend, old, mine)
        timings["old_logprob"] = time.perf_counter() - t0
    ref = None
    if ref_model is not None:
        t0 = time.perf_counter()
        ref = torch.zeros(B, L)
        with torch.no_grad():
            ref[mine] = _batched_logprobs(ref_model, batch, mine, sched.micro_batch_size,
                                          device)
        ref = _gather_rows(backend, ref, mine)
        timings["ref_logprob"] = time.perf_counter() - t0

    # 6. advantages per turn -> tokens (every rank, on the whole batch: same result) ---------
    t0 = time.perf_counter()
    K = batch.turn_mask.shape[1]
    per_turn = turn_advantages(method, advantage_inputs(tok, trajs, igs))
    adv_BK = per_turn_tensor([p.advantages for p in per_turn], K, 0.0)
    adv_BT = gather_turns(adv_BK, batch.turn_id)
    clip_BT = None
    if method.loss.adaptive_clip and per_turn and per_turn[0].clip_scales is not None:
        clip_BK = per_turn_tensor([p.clip_scales for p in per_turn], K, 1.0)
        clip_BT = gather_turns(clip_BK, batch.turn_id, fill=1.0)
    timings["advantage"] = time.perf_counter() - t0

    # 7. updates: ppo_epochs x mini-batches (by prompt) x micro-batches. Each rank takes rows
    # rank::world of a mini-batch; the counts are the whole mini-batch's, and dp_size = world
    # makes the average over ranks the unsplit loss (masks.aggregate_loss)
    backend.unwrapped.train()
    t0 = time.perf_counter()
    groups = list(dict.fromkeys(batch.group_ids))
    loss_log: dict[str, list[float]] = defaultdict(list)
    clip_by_turn: dict[int, list[float]] = defaultdict(list)
    grad_norms = []
    rng = random.Random(seed)
    need_ent = method.loss.entropy_coef > 0 or method.loss.entropy_adv_alpha > 0
    norm_length = cfg.rollout.max_response_tokens
    for _ in range(sched.ppo_epochs):
        order_groups = groups[:]
        rng.shuffle(order_groups)
        for m in range(0, len(order_groups), sched.mini_batch_prompts):
            chosen = set(order_groups[m: m + sched.mini_batch_prompts])
            rows = [b for b in range(B) if batch.group_ids[b] in chosen]
            tokens, seqs = local_denominators(batch.loss_mask[rows])
            my_rows = rows[rank::world]
            # every rank makes the same number of forward/backward calls (ZeRO collectives);
            # a rank short of rows runs a micro-batch whose loss mask is all zero
            n_micro = math.ceil(math.ceil(len(rows) / world) / sched.micro_batch_size)
            for i in range(n_micro):
                mb = my_rows[i * sched.micro_batch_size: (i + 1) * sched.micro_batch_size]
                mask = batch.loss_mask[mb].to(device)
                if not mb:
                    mb = rows[:1]
                    mask = torch.zeros_like(batch.loss_mask[mb]).to(device)
                logp, ent = token_logprobs(backend.model, batch, mb, with_entropy=need_ent,
                                           device=device)
                adv = adv_BT[mb].to(device)
                if method.loss.entropy_adv_alpha > 0:
                    adv = entropy_aware_advantage(adv_BT=adv, entropy_BT=ent.detach(),
                                                  mask_BT=mask,
                                                  alpha=method.loss.entropy_adv_alpha)
                pg, diag = policy_loss(
                    logp_BT=logp, old_logp_BT=old[mb].to(device), adv_BT=adv, mask_BT=mask,
                    ratio_level=method.loss.ratio_level, clip_low=method.loss.clip_low,
                    clip_high=method.loss.clip_high, agg_mode=method.loss.agg_mode,
                    clip_scale_BT=None if clip_BT is None else clip_BT[mb].to(device),
                    dual_clip=method.loss.dual_clip, upper_clip=method.loss.upper_clip,
                    turn_id_BT=batch.turn_id[mb].to(device), K=K, global_tokens=tokens,
                    global_seqs=seqs, dp_size=world, norm_length=norm_length)
                loss = pg
                if ref is not None:
                    kl = kl_penalty(logp_BT=logp, ref_logp_BT=ref[mb].to(device),
                                    kind=method.loss.kl_kind)
                    kl_term = aggregate_loss(kl, mask, method.loss.agg_mode,
                                             global_tokens=tokens, global_seqs=seqs,
                                             dp_size=world, norm_length=norm_length)
                    loss = loss + method.loss.kl_coef * kl_term
                    loss_log["kl"].append(float(kl_term.detach()) / world)
                if method.loss.entropy_coef > 0:
                    ent_term = aggregate_loss(ent, mask, method.loss.agg_mode,
                                              global_tokens=tokens, global_seqs=seqs,
                                              dp_size=world, norm_length=norm_length)
                    loss = loss - method.loss.entropy_coef * ent_term
                backend.backward(loss)
                # each term carries the factor `world`: / world makes the sum over ranks the
                # unsplit mini-batch's value
                loss_log["total"].append(float(loss.detach()) / world)
                loss_log["pg"].append(float(pg.detach()) / world)
                if not mask.any():
                    continue
                for key in ("pg_clipfrac", "pg_clipfrac_low", "pg_clipfrac_high", "ppo_kl",
                            "ratio_mean"):
                    if key in diag and torch.isfinite(torch.as_tensor(diag[key])):
                        loss_log[key].append(float(diag[key]))
                for k, v in diag.get("pg_clipfrac_by_turn", {}).items():
                    clip_by_turn[int(k)].append(float(v))
            grad_norms.append(backend.step())
            scheduler.step()
    timings["update"] = time.perf_counter() - t0
    backend.unwrapped.eval()
    if cfg.engine == "vllm":  # the hf engine samples from this very model object
        engine.update_weights(backend.hf_state_dict() or {})
    for key in ("total", "pg", "kl"):  # sums over ranks (the diagnostics stay rank 0's)
        if key in loss_log:
            loss_log[key] = [backend.all_reduce_sum(float(np.sum(loss_log[key])))]

    # 8. metrics ---------------------------------------------------------------------------
    rewards = np.array([t.reward for t in trajs])
    calls = [t.num_tool_calls for t in trajs]
    stops = Counter(t.turns[-1].stop for t in trajs)
    spread = Counter()
    for g in groups:
        r = {t.reward for t in trajs if t.group_id == g}
        spread["zero" if len(r) <= 1 else "some"] += 1
    updates = max(1, len(grad_norms))
    metrics = {
        "train/reward": float(rewards.mean()),
        "train/em": float(np.mean([t.extra["em"] for t in trajs])),
        "train/format_fail": float(np.mean([not t.extra["format_ok"] for t in trajs])),
        "rollout/trajectories": len(trajs),
        "rollout/tool_calls": float(np.mean(calls)),
        "rollout/response_tokens": float(np.mean([t.response_length() for t in trajs])),
        "rollout/obs_tokens": float(np.mean([sum(len(x.obs_ids) for x in t.turns)
                                            for t in trajs])),
        "rollout/truncated": float(np.mean([t.turns[-1].stop in ("length", "max_tokens")
                                           for t in trajs])),
        "rollout/zero_variance_groups": spread["zero"] / max(1, len(groups)),
        "rollout/gen_batches": gen_batches,
        "rollout/retrieval_calls": retrieval_calls,
        "rollout/entropy": float(np.mean([x.entropy for t in trajs for x in t.turns])),
        # per update: the micro-batch terms of an update sum to its loss (global denominators)
        "loss/total": float(loss_log["total"][0] / updates),
        "optim/grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
        "optim/lr": float(scheduler.get_last_lr()[0]),
        "time/step": time.perf_counter() - tic,
    }
    for c in range(max(calls) + 1):
        metrics[f"rollout/tool_calls_dist/{c}"] = calls.count(c) / len(calls)
    for s_, n in stops.items():
        metrics[f"rollout/stop/{s_}"] = n / len(trajs)
    for key, vals in loss_log.items():
        if key in ("pg", "kl"):
            metrics[f"loss/{key}"] = float(vals[0] / updates)
        elif key != "total":
            metrics[f"loss/{key}"] = float(np.mean(vals))
    for k, vals in clip_by_turn.items():
        metrics[f"clip/by_turn/{k}"] = float(np.mean(vals))
    for k in range(K):
        col = [p.advantages[k] for p in per_turn if len(p.advantages) > k]
        if col:
            metrics.update({f"adv/turn{k}/mean": float(np.mean(col)),
                            f"adv/turn{k}/std": float(np.std(col)),
                            f"adv/turn{k}/min": float(np.min(col)),
                            f"adv/turn{k}/max": float(np.max(col))})
        if igs is not None:
            ig_col = [g[k] for g in igs if len(g) > k and g[k] is not None]
            if ig_col:
                metrics[f"ig/turn{k}/mean"] = float(np.mean(ig_col))
                metrics[f"ig/turn{k}/std"] = float(np.std(ig_col))
    if ig_stats:
        metrics["ig/extra_token_ratio"] = (ig_stats["ig_tokens"]
                                           / max(1, ig_stats["trajectory_tokens"]))
    for k, v in timings.items():
        metrics[f"time/{k}"] = v
    gen_tokens = sum(len(x.action_ids) for t in trajs for x in t.turns)
    metrics["throughput/rollout_tokens_per_s"] = gen_tokens / max(
        1e-9, timings["rollout"] + timings["retrieval"])
    metrics["throughput/update_tokens_per_s"] = float(batch.attention_mask.sum()) \
        * sched.ppo_epochs / max(1e-9, timings["update"])
    seen: Counter = Counter()
    sample = []
    for b, t in enumerate(trajs):
        sample.append(_rollout_record(tok, t, seen[t.group_id], per_turn[b].advantages))
        seen[t.group_id] += 1
    return metrics, sample


def _rollout_record(tok, t: Trajectory, index: int, advantages) -> dict:
    """One trajectory as rollouts.jsonl stores it: turn texts, queries, reward, advantages."""
    turns = [{"turn": k, "stop": turn.stop, "query": turn.query,
              "text": tok.decode(list(turn.action_ids), skip_special_tokens=True)}
             for k, turn in enumerate(t.turns)]
    return {"group": str(t.group_id), "index": index, "reward": float(t.reward),
            "advantages": [float(a) for a in advantages], "turns": turns}
