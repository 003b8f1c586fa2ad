"""The RL training recipe: one readable loop for every method of config/methods/.

`train` sets a run up (or resumes it), then calls `train_step` once per step and validates,
logs and checkpoints on schedule. One step, as `train_step` reads (the papers' verl loop):
  1. sample prompts: the seeded, resumable data order; each rank takes its share
  2. roll out: chains, Tree-GRPO trees, AT2PO trees or AEPO branching, per the method
  3. rewards (the one reward implementation), DAPO overlong shaping
  4. DAPO dynamic sampling: drop groups without spread in `dapo.filter_metric`, refill
  5. old log-probs; with information gain on, the gold answer's log-probs at every probe
     point from the same forward (IGPO family)
  6. reference log-probs when the loss has a KL term
  7. advantages per turn (`a2tgpo.algo.turn_advantage_tensors`) and their clip scales,
     broadcast to tokens by turn id
  8. ppo_epochs x mini-batches x micro-batches, losses with the mini-batch's global
     denominators, one optimizer update per mini-batch (a2tgpo/train/update.py)
  9. weights to the rollout engines: every rank's engine gets that rank's own weights
 10. metrics and rollout samples (all of the step's trajectories in rollouts.jsonl; a few, in
     the readable form, as the MLflow run's artifacts)
A vLLM engine sleeps (frees its memory) from after the rollouts until the update is done; its
weights are woken for the weight sync and its KV cache after it. At each of these phase
boundaries the trainer hands the memory it freed back to the device (a2tgpo/train/memory.py),
and with train.offload_optimizer the optimizer state waits in host memory while the engine is
awake.
Nothing here is method-specific beyond reading the method's settings.

Under `backend: deepspeed` every rank runs all of it: each rank (with `rollout_tp` > 1, the
first rank of each group, on the group's GPUs) rolls out and scores its share of the step's
questions with its own engine, the trajectories are gathered so every rank holds the whole batch in
the same order, log-prob passes split rows over ranks and gather them back, and each update
splits its mini-batch's rows over the ranks (a2tgpo/train/distributed.py). Rank 0 alone
writes the run folder and tracks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from a2tgpo.algo.advantages import dynamic_sampling_keep, overlong_penalty
from a2tgpo.algo.api import TurnInputs, turn_advantage_tensors
from a2tgpo.algo.info_gain import ig_by_turn, information_gain
from a2tgpo.algo.masks import gather_turns
from a2tgpo.algo.methods import MethodConfig
from a2tgpo.cell import Cell, archive_dir, archive_stamp
from a2tgpo.config import dump_config, dump_yaml, format_value, to_dict
from a2tgpo.data.qa import dataset_input
from a2tgpo.io import atomic_write_json
from a2tgpo.model.backbone import load_model, load_tokenizer
from a2tgpo.ops.lock import folder_lock
from a2tgpo.ops.preemption import (
    EXIT_PREEMPTED,
    PreemptionHandler,
    StopRequested,
    TimeBudget,
)
from a2tgpo.progress import duration, eta_s, progress_bar
from a2tgpo.retrieval.retriever import build_retriever
from a2tgpo.rollout.agent import Question, RolloutStats, SearchTool
from a2tgpo.rollout.engine import Engine
from a2tgpo.rollout.failures import outcome_metrics
from a2tgpo.rollout.info_gain import build_probe, gold_logprob_matrix, score_gold_logprobs
from a2tgpo.rollout.trajectory import Batch, Trajectory, collate
from a2tgpo.rollout.weight_checksum import state_checksum
from a2tgpo.tracking import METRICS_FILE, STUDY_RUN_TAG, Tracker, cut_after, study_run_name
from a2tgpo.train.best import best_step
from a2tgpo.train.checkpoint import (
    BACKEND_DIR,
    DataOrder,
    load_checkpoint,
    resume_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from a2tgpo.train.config import TrainConfig
from a2tgpo.train.distributed import (
    Backend,
    DeepSpeedBackend,
    EnginePlacement,
    SingleBackend,
    engine_placement,
    init_distributed,
    launcher_env,
    shutdown_distributed,
)
from a2tgpo.train.episodes import (
    GREEDY_SEED,
    load_questions,
    make_engine,
    resolve_device,
    rollout,
    score,
    search_tool,
)
from a2tgpo.train.lineage import KEY as IDENTITY_KEY
from a2tgpo.train.lineage import archive_superseded, identity_changes, run_identity
from a2tgpo.train.memory import PhaseMemory, job_peak, release
from a2tgpo.train.reference import ReferencePolicy
from a2tgpo.train.update import (
    UpdateBatch,
    UpdateLog,
    micro_batches,
    update_logprobs,
    update_policy,
)

log = logging.getLogger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"
# the readable sample of a rollouts.jsonl step the MLflow run gets (artifacts rollouts/
# step_NNNNNN.json): the first SAMPLE_GROUPS prompt groups whole (advantages are relative
# within a group), at most SAMPLE_TRAJECTORIES trajectories, so a 240-step run logs ~25 small files
SAMPLE_DIR, SAMPLE_GROUPS, SAMPLE_TRAJECTORIES = "rollout_samples", 2, 8


# --------------------------------------------------------------------------------------------
# the run and the loop


@dataclass
class Run:
    """One training job: what every step of the recipe reads."""

    cfg: TrainConfig
    backend: Backend
    placement: EnginePlacement
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref: ReferencePolicy | None  # methods with a KL term
    tok: Any
    engine: Engine
    tool: SearchTool
    train_qs: list[Question]
    dev_qs: list[Question]
    order: DataOrder
    start: int  # steps already done (a resume starts after them)
    best: dict = field(default_factory=lambda: {"step": None, "val_em": -1.0})
    tracker: Tracker | None = None
    saved: int | None = None  # the step of the newest checkpoint
    pending_validation: bool = False  # the newest checkpoint's validation was cut short
    identity: dict | None = None  # rank 0: the config and inputs it was started from (lineage.py)

    @property
    def main(self) -> bool:
        return self.backend.rank == 0

    @functools.cached_property
    def questions(self) -> dict[str, Question]:
        """Training and dev questions by id (their hop counts and types, for the failure
        breakdown)."""
        return {q.id: q for q in (*self.train_qs, *self.dev_qs)}


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) one training job; returns the final summary. A time limit or a
    preemption ends it early with a checkpoint and EXIT_PREEMPTED (a2tgpo/ops/preemption.py):
    safe points are each rollout wave and the end of each step."""
    # the stop handler before the set-up (loading a model takes minutes); the run folder's
    # writer lock before anything is written there
    with PreemptionHandler() as preempt, _run_folder_lock(cfg):
        run = start_run(cfg)
        if run.main:  # the steps after the checkpoint resumed from are redone: logged once
            for name in (METRICS_FILE, ROLLOUTS_FILE):
                cut_after(Path(cfg.run_dir) / name, run.saved)
        with run.tracker:
            if run.main:  # what the run trains and validates on: the Dataset column
                run.tracker.log_inputs(
                    [dataset_input(cfg.train_file, "training",
                                   sha256=run.identity["inputs"]["train_file"]),
                     dataset_input(cfg.dev_file, "validation",
                                   sha256=run.identity["inputs"]["dev_file"])])
            summary = _loop(run, preempt)
    _close(run)
    return summary


def _loop(run: Run, preempt: PreemptionHandler) -> dict:
    cfg, sched = run.cfg, run.cfg.schedule
    budget = TimeBudget(cfg.stop_margin_s)
    first = run.start if cfg.method.train else sched.steps  # ReAct: the starting policy only
    try:
        if run.start == 0:
            run.tracker.log(validate(run, 0), 0)
            save(run, 0)
        elif run.pending_validation:  # cut short by the stop that ended the previous job
            run.tracker.log(validate(run, run.start), run.start)
    except StopRequested as e:
        _stop(run, None, str(e))  # nothing new to save
    # into a file, the step's log line is the progress line (report_step)
    bar = progress_bar(range(first, sched.steps), desc=f"{cfg.method.id} seed {cfg.seed}",
                       unit="step", initial=first, total=sched.steps, disable=not run.main,
                       lines=False)
    t_first = time.perf_counter()  # the pace of this job's steps, for the ETA
    streak = 0  # consecutive non-finite steps
    for step in bar:
        # the ranks agree: one may have been signalled, or read the clock a little later
        out_of_time = not budget.next_step_fits()
        if run.backend.all_reduce_sum(float(out_of_time or preempt.requested)) > 0:
            _stop(run, step, "the job's time budget" if out_of_time else "a stop request")
        t0 = time.perf_counter()
        at_start = rng_state(), run.order.state_dict()
        try:
            metrics, sample = train_step(run, step)
        except StopRequested as e:  # during the rollouts: back to the step's start
            set_rng_state(at_start[0])
            run.order.load_state_dict(at_start[1])
            _stop(run, step, f"{e}, step {step + 1} abandoned")
        done, pending = step + 1, False
        # every rank sees the same values (summed / global), so all stop together
        bad = {k: metrics[k] for k in NONFINITE_KEYS
               if k in metrics and not math.isfinite(metrics[k])}
        streak = streak + 1 if bad else 0
        if streak > sched.max_nonfinite_steps:
            run.tracker.log(metrics, done)  # the record shows the step that stopped it
            raise NonFiniteTraining(
                f"step {done}: " + ", ".join(f"{k} = {v}" for k, v in bad.items())
                + f" ({streak} non-finite step(s) in a row; schedule.max_nonfinite_steps is "
                f"{sched.max_nonfinite_steps}); nothing of it was saved, the newest checkpoint "
                f"is step {run.saved}. Lower optim.lr or tighten optim.grad_clip, then rerun: "
                "it resumes from that checkpoint")
        if done % sched.eval_every == 0 or done == sched.steps:
            try:
                metrics.update(validate(run, done))
            except StopRequested:
                pending = True  # the resumed run validates this step first
        run.tracker.log(metrics, done)
        report_step(run, bar, done, metrics, sample,
                    eta_s(time.perf_counter() - t_first, done - first, sched.steps - first))
        stop = pending or run.backend.all_reduce_sum(float(preempt.requested)) > 0
        if done % sched.save_every == 0 or done == sched.steps or stop:
            t_save = time.perf_counter()
            save(run, done, pending_validation=pending)
            budget.save_took(time.perf_counter() - t_save)
        if stop:
            _stop(run, done, "a stop request")
        budget.step_took(time.perf_counter() - t0)
    summary = {"steps": sched.steps, "best_step": run.best["step"],
               "best_val_em": run.best["val_em"]}
    # the job's peak memory: summary.json and the MLflow run, not the returned summary
    run.tracker.summary({**summary, **job_peak("peak_memory/train")})
    return summary


# a step's values that must be finite for training to go on (update.py UpdateLog.metrics)
NONFINITE_KEYS = ("loss/total", "optim/grad_norm")


class NonFiniteTraining(RuntimeError):
    """Training produced a non-finite loss or gradient norm more often than tolerated."""


def _stop(run: Run, step: int | None, why: str) -> None:
    """Checkpoint `step` (None: nothing to save) unless it is the newest checkpoint already,
    then exit with EXIT_PREEMPTED."""
    if step is not None and run.saved != step:
        save(run, step)
    if run.main:
        log.warning("stopping for %s: newest checkpoint step %s; exit %d (resumable)", why,
                    run.saved, EXIT_PREEMPTED)
    _close(run)
    raise SystemExit(EXIT_PREEMPTED)


def train_step(run: Run, step: int) -> tuple[dict, list[dict]]:
    """One RL step, the numbered recipe of the module docstring. Returns the step's metrics
    and its sampled trajectories (rollouts.jsonl records)."""
    cfg, method = run.cfg, run.cfg.method
    clock = Clock()
    seed = cfg.seed * 1_000_003 + step
    # 1-4. prompts, rollouts, rewards, dynamic sampling (every rank: the whole batch)
    trajs, sampling = sample_groups(run, seed, clock)
    # every phase boundary hands freed memory back to the device (the engine shares it)
    memory = PhaseMemory(run.backend.device)
    if run.engine is not None:  # its memory is free for the log-prob passes and the update
        with clock("engine_sleep"):
            run.engine.sleep()
    memory.boundary("rollout")
    batch = collate(trajs, run.tok.pad_token_id)
    # 5. old log-probs (+ gold-answer log-probs at the probe points: information gain)
    old_BL, gold_BP, ig_stats = old_logprobs(run, batch, trajs, clock, seed=seed)
    # 6. reference log-probs
    ref_BL = reference_logprobs(run, batch, clock)
    # 7. advantages per turn and their clip scales, broadcast to tokens
    with clock("advantage"):
        adv = token_advantages(method, batch, trajs, gold_BP, run.tok)
    memory.boundary("logprob")
    # 8. the updates (the optimizer state back on the device first, where it was offloaded)
    with clock("update"):
        run.backend.reload_states()
        update = update_policy(run.backend, run.scheduler,
                               UpdateBatch(batch, old_BL, adv.adv_BL, ref_BL, adv.clip_BL),
                               method.loss, cfg.schedule, seed=seed,
                               norm_length=cfg.rollout.max_response_tokens)
    # 9. weights to the rollout engines, with the optimizer state in host memory meanwhile
    # (train.offload_optimizer) and the trainer's cache handed back
    if run.cfg.offload_optimizer:
        with clock("offload"):
            run.backend.offload_states()
    memory.boundary("update")
    sync = wake_and_sync(run, clock)
    memory.boundary("awake")
    # 10. metrics and samples
    metrics = step_metrics(run, trajs, batch, adv, update, sampling, ig_stats, clock)
    metrics.update(sync)
    metrics.update(memory.metrics())
    metrics.update(engine_mismatch(run.backend, trajs, batch, old_BL))
    return metrics, rollout_records(run.tok, trajs, adv.adv_BK, batch.num_turns)


# --------------------------------------------------------------------------------------------
# set-up, validation, checkpoints, progress


def start_run(cfg: TrainConfig) -> Run:
    """Model, optimizer, backend, engine, search tool and data order of a job; a run folder
    with a complete checkpoint is resumed from its newest one."""
    distributed = cfg.backend == "deepspeed"
    rank, device, placement = _process(cfg)
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(cfg, run_dir / "config.yaml")
    seed_everything(cfg.seed)
    tok = load_tokenizer(cfg.backbone)
    model = load_model(cfg.backbone, device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the starting policy, before a checkpoint's weights are loaded into `model`
    ref = (ReferencePolicy(model, cfg.reference, device) if cfg.method.loss.kl_coef > 0
           else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    warm = max(1, cfg.optim.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: min(1.0, (u + 1) / warm))
    # a question whose prompt is over the prompt budget is refused here, before any rollout
    train_qs = load_questions(cfg.train_file, cfg=cfg, tok=tok)
    order = DataOrder(len(train_qs), seed=cfg.seed, epochs=_epochs(cfg, len(train_qs)))
    start, best, pending = 0, {"step": None, "val_em": -1.0}, False
    identity = run_identity(cfg) if rank == 0 else None
    ckpt = _resume_point(cfg, identity, rank, distributed)
    # optimizer state in the checkpoint's backend/ (older checkpoints of this project: in
    # state.pt, single process only)
    in_backend = ckpt is not None and (ckpt / BACKEND_DIR).is_dir()
    if ckpt is not None:
        # weights before the backend wraps them
        state = load_checkpoint(ckpt, model=model, scheduler=scheduler,
                                optimizer=None if in_backend or distributed else optimizer,
                                verify=False)  # rank 0 verified it
        start, best = state["step"], state["best"]
        pending = state.get("pending_validation", False)
        order.load_state_dict(state["data_order"])
        log.info("resumed from %s (step %d)", ckpt, start)
    backend = _make_backend(cfg, model, optimizer)
    if in_backend:
        backend.load_state(ckpt / BACKEND_DIR)
    elif ckpt is not None and distributed:
        raise ValueError(f"{ckpt} keeps no optimizer state ({BACKEND_DIR}/): only the newest "
                         "schedule.optimizer_states checkpoints do, and a run resumes from "
                         "the newest intact one")
    if cfg.offload_optimizer:  # host memory until the first update, as after every update
        backend.offload_states()
    # what model loading and ZeRO's flattening freed goes back to the device before the
    # engine measures its free memory
    release(backend.device)
    engine = (make_engine(cfg, backend.unwrapped, tok, placement.devices)
              if placement.hosts_engine else None)
    run = Run(cfg=cfg, backend=backend, placement=placement, optimizer=optimizer,
              scheduler=scheduler, ref=ref, tok=tok, engine=engine,
              tool=search_tool(cfg, build_retriever(cfg.retrieval, cfg.corpus, cfg.index), tok),
              train_qs=train_qs,
              dev_qs=load_questions(cfg.dev_file, cfg.schedule.eval_questions, cfg=cfg, tok=tok),
              order=order, start=start, best=best,
              saved=None if ckpt is None else start, pending_validation=pending,
              identity=identity)
    run.tracker = _tracker(cfg) if run.main else _NoTracker()
    if ckpt is not None:  # engines started from the backbone: give them the checkpoint's
        sync_engine(run, Clock())
    return run


# what validate() writes to metrics.jsonl: the mean over the dev trajectories of each value
# here (val/<name>), the outcome shares (val/outcome/..., rollout/failures.py) and the time
# (val/seconds); `validation_metrics` lists the keys, a sweep's objective must be one of them
VAL_MEANS: dict[str, Callable[[Trajectory], float]] = {
    "em": lambda t: t.extra["em"],
    "f1": lambda t: t.extra["f1"],
    "format_ok": lambda t: t.extra["format_ok"],
    "tool_calls": lambda t: t.num_tool_calls,
}
VAL_OUTCOME, VAL_SECONDS = "val/outcome", "val/seconds"


def validation_metrics() -> list[str]:
    """The keys of validate()'s metrics; `*` stands for a hop type the data states."""
    from a2tgpo.rollout.failures import OUTCOMES, outcome_shares

    return [*(f"val/{name}" for name in VAL_MEANS),
            *outcome_shares(OUTCOMES, ["*"] * len(OUTCOMES), VAL_OUTCOME), VAL_SECONDS]


def validate(run: Run, step: int) -> dict:
    """Greedy dev rollouts (each rank its share); updates the best trained step. The metrics go
    into the step's one metrics.jsonl row."""
    cfg, backend = run.cfg, run.backend
    backend.unwrapped.eval()
    t0 = time.perf_counter()
    mine = run.placement.share(run.dev_qs)
    trajs = _gather(backend, score(cfg, run.tok, _rollout(run, mine, seed=GREEDY_SEED,
                                                          greedy=True), training=False))
    means = {f"val/{name}": float(np.mean([value(t) for t in trajs])) if trajs else 0.0
             for name, value in VAL_MEANS.items()}
    em = means["val/em"]
    known = {} if run.best["step"] is None else {run.best["step"]: run.best["val_em"]}
    if best_step({**known, step: em}, trains=cfg.method.train) == step:
        run.best.update(step=step, val_em=em)
    if run.main:
        log.info("step %d validation: EM %.3f on %d dev questions", step, em, len(trajs))
    return {**means, **outcome_metrics(trajs, run.tok, run.questions, VAL_OUTCOME),
            VAL_SECONDS: time.perf_counter() - t0}


def save(run: Run, step: int, *, pending_validation: bool = False) -> None:
    """Checkpoint `step`: rank 0 writes the weights and trainer state, and every rank adds its
    optimizer state (its shard, under DeepSpeed) to the folder's backend/ before the folder
    is marked complete. Older kept checkpoints then drop their backend/ (weights only)."""
    backend = run.backend
    run.saved = step

    def backend_state(tmp: Path | None) -> None:
        if tmp is not None:
            (tmp / BACKEND_DIR).mkdir()
        where = backend.broadcast_object(str(tmp) if tmp is not None else None)
        backend.save_state(Path(where) / BACKEND_DIR)
        backend.barrier()

    release(backend.device)
    if not run.main:
        backend_state(None)
        return
    keep = {run.best["step"]} if run.best["step"] is not None else set()
    save_checkpoint(Path(run.cfg.run_dir), step, model=backend.unwrapped, tokenizer=run.tok,
                    optimizer=None, scheduler=run.scheduler,
                    keep_last=run.cfg.schedule.keep_last, keep_steps=keep,
                    optimizer_states=run.cfg.schedule.optimizer_states,
                    trainer_state={"step": step, "best": dict(run.best),
                                   "data_order": run.order.state_dict(),
                                   "pending_validation": pending_validation,
                                   IDENTITY_KEY: run.identity},
                    extra_state=backend_state)


def report_step(run: Run, bar, done: int, metrics: dict, sample: list[dict],
                eta: float | None = None) -> None:
    """Progress bar, one log line per step (with `eta`, the seconds left), and (on validation
    steps and the first) the step's sampled trajectories in rollouts.jsonl."""
    sched = run.cfg.schedule
    bar.set_postfix(reward=f"{metrics['train/reward']:.2f}", em=f"{metrics['train/em']:.2f}")
    if not run.main:
        return
    if done == 1 or done % sched.eval_every == 0 or done == sched.steps:
        with open(Path(run.cfg.run_dir) / ROLLOUTS_FILE, "a") as f:
            for t in sample:
                f.write(json.dumps({"step": done, **t}) + "\n")
        run.tracker.log_artifact(write_rollout_sample(run, done, sample), "rollouts")
    log.info("step %d/%d: reward %.3f EM %.3f loss %.4f calls %.2f (%.1f s, ETA %s)", done,
             sched.steps, metrics["train/reward"], metrics["train/em"], metrics["loss/total"],
             metrics["rollout/tool_calls"], metrics["time/step"],
             "?" if eta is None else duration(eta))
    if metrics["rollout/obs_cut"] > 0.1:
        log.warning("step %d: rollout.max_obs_tokens (%d) cut the passages of %.0f%% of the "
                    "observations; a policy trained on whole ones may misread them", done,
                    run.cfg.rollout.max_obs_tokens, 100 * metrics["rollout/obs_cut"])


def write_rollout_sample(run: Run, step: int, records: list[dict]) -> Path:
    """`<run_dir>/rollout_samples/step_NNNNNN.json`: the step's first SAMPLE_GROUPS groups of
    `records` (rollout_records rows; at most SAMPLE_TRAJECTORIES), each with its question and
    gold answers. A resumed run that redoes the step writes the file again."""
    groups = list(dict.fromkeys(r["group"] for r in records))[:SAMPLE_GROUPS]
    picked = [r for r in records if r["group"] in groups][:SAMPLE_TRAJECTORIES]
    rows = []
    for r in picked:
        q = run.questions.get(r["question_id"])
        rows.append({"question": q.question if q else None,
                     "golden_answers": list(q.golden_answers) if q else None, **r})
    path = Path(run.cfg.run_dir) / SAMPLE_DIR / f"step_{step:06d}.json"
    path.parent.mkdir(exist_ok=True)
    atomic_write_json(path, {"step": step, "trajectories": len(records), "sample": rows})
    return path


# --------------------------------------------------------------------------------------------
# steps 1-4: prompts, rollouts, rewards, dynamic sampling


def sample_groups(run: Run, seed: int, clock: Clock) -> tuple[list[Trajectory], dict]:
    """Scored trajectories of the step's prompt groups, in the same order on every rank, and
    {"gen_batches", "retrieval_calls", "obs_cut"} with this rank's rollout times
    (`ROLLOUT_TIMES`). Without dynamic sampling one generation batch is the step; with it,
    groups whose `dapo.filter_metric` has no spread are dropped and further batches drawn
    until `prompts_per_step` groups are kept."""
    cfg, backend, dapo = run.cfg, run.backend, run.cfg.method.dapo
    want = cfg.schedule.prompts_per_step
    n_prompts = want * (dapo.gen_batch_multiplier if dapo.dynamic_sampling else 1)
    calls_before, retrieval_before = run.tool.calls, run.tool.seconds
    obs_before, cut_before = run.tool.observations, run.tool.cut
    run.tool.stats.take()  # what validation's rollouts left
    kept: list[Trajectory] = []
    gen_batches = 0
    while True:
        gen_batches += 1
        # every rank draws the same questions (same data order), then keeps its share
        qs = [run.train_qs[i] for i in run.order.next_batch(n_prompts)]
        with clock("rollout"):
            trajs = _rollout(run, run.placement.share(qs),
                             seed=seed + 7919 * gen_batches + 104_729 * backend.rank)
        trajs = _gather(backend, shape_rewards(cfg, score(cfg, run.tok, trajs, training=True)))
        if not dapo.dynamic_sampling:
            kept = trajs
            break
        keep = dynamic_sampling_keep(metric_B=filter_metric(trajs, dapo.filter_metric),
                                     group_B=[t.group_id for t in trajs])
        kept += [t for t, k in zip(trajs, keep.tolist(), strict=True) if k]
        groups = list(dict.fromkeys(t.group_id for t in kept))
        if len(groups) >= want:
            kept = [t for t in kept if t.group_id in set(groups[:want])]
            break
        if gen_batches >= dapo.max_num_gen_batches > 0:
            raise RuntimeError(
                f"DAPO dynamic sampling: only {len(groups)} of {want} groups with "
                f"{dapo.filter_metric} spread after {gen_batches} generation batches "
                "(dapo.max_num_gen_batches); the policy's rewards are nearly constant")
    times = rollout_times(clock.times["rollout"], run.tool.stats.take())
    # retrieval happens inside the rollout: reported on its own, and taken out of "rollout"
    clock.times["retrieval"] = run.tool.seconds - retrieval_before
    clock.times["rollout"] -= clock.times["retrieval"]
    calls = int(backend.all_reduce_sum(float(run.tool.calls - calls_before)))
    obs = backend.all_reduce_sum(float(run.tool.observations - obs_before))
    cut = backend.all_reduce_sum(float(run.tool.cut - cut_before))
    return kept, {"gen_batches": gen_batches, "retrieval_calls": calls,
                  "obs_cut": cut / obs if obs else 0.0, **times}


# this rank's rollout, per step (metrics rollout/<key>): its wall seconds (retrieval included),
# the share of them the engine had a generation in flight, the longest trajectory's seconds,
# and the mean seconds a trajectory waited on search (query sent -> observation appended)
ROLLOUT_TIMES = ("seconds", "engine_busy", "longest_trajectory_s", "search_wait_s")


def rollout_times(seconds: float, stats: RolloutStats) -> dict[str, float]:
    """`ROLLOUT_TIMES` from the rollouts' wall seconds and the tool's `RolloutStats`."""
    return dict(zip(ROLLOUT_TIMES, (
        seconds, min(1.0, stats.engine_busy_s / seconds) if seconds > 0 else 0.0,
        stats.longest_s, stats.search_wait_s / stats.trajectories if stats.trajectories
        else 0.0), strict=True))


def _rollout(run: Run, questions: list[Question], *, seed: int, greedy: bool = False
             ) -> list[Trajectory]:
    """This rank's rollouts of `questions` by its own engine, each marked with the rank (for
    the engine-vs-trainer check); none where the rank hosts no engine.

    A stop requested during any rank's waves raises StopRequested on every rank: the ranks
    agree first (every rank reaches this sum once per call), so none is left waiting in the
    gather that follows."""
    trajs, stopped = [], False
    try:
        if questions:
            trajs = rollout(run.cfg, questions, run.engine, run.tool, seed=seed,
                            greedy=greedy)
    except StopRequested:
        stopped = True
    if run.backend.all_reduce_sum(float(stopped)) > 0:
        raise StopRequested("stop requested during the rollouts")
    return [replace(t, extra={**t.extra, "rank": run.backend.rank}) for t in trajs]


def shape_rewards(cfg: TrainConfig, trajs: list[Trajectory]) -> list[Trajectory]:
    """DAPO's overlong shaping (when on): the length penalty added to each reward; the reward
    before it stays in extra["score"]."""
    dapo = cfg.method.dapo
    if not dapo.overlong_buffer:
        return trajs
    pen = overlong_penalty(length_B=torch.tensor([t.response_length() for t in trajs]),
                           max_length=cfg.rollout.max_response_tokens,
                           buffer_length=dapo.overlong_buffer,
                           penalty_factor=dapo.overlong_factor)
    return [replace(t, reward=t.reward + float(p), extra={**t.extra, "score": t.reward})
            for t, p in zip(trajs, pen, strict=True)]


def filter_metric(trajs: list[Trajectory], metric: str) -> torch.Tensor:
    """The per-trajectory value whose spread within a group keeps the group (verl's DAPO
    `filter_groups.metric`): acc = exact match; score = the reward before overlong shaping;
    seq_reward = the reward the advantages use; seq_final_reward = the same here (this
    project puts no KL penalty into the reward). -> (B,)"""
    if metric == "acc":
        values = [t.extra["em"] for t in trajs]
    elif metric == "score":
        values = [t.extra.get("score", t.reward) for t in trajs]
    elif metric in ("seq_reward", "seq_final_reward"):
        values = [t.reward for t in trajs]
    else:
        raise ValueError(f"unknown dapo.filter_metric {metric!r}")
    return torch.tensor(values, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# steps 5-7: log-probs, information gain, advantages


def old_logprobs(run: Run, batch: Batch, trajs: list[Trajectory], clock: Clock, *, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """log π_old of every token, (B, L), and with information gain on, the gold answer's mean
    log-prob at each trajectory's probe points (B, P) (NaN past its last point) and the IG
    pass's token counts.

    log π_old comes from `update_logprobs`: the update's own module and row grouping (its
    mini-batches for `seed`, the step's update seed, and each rank's micro-batches), so the
    first update's ratios are exactly 1 in bf16 too. The IG pass (rows rank::world, gathered
    back) runs the trajectories for its KV cache anyway, but groups them otherwise (padded
    batches of ig_batch_size), so its token log-probs are not used: IG methods pay one more
    forward over the batch (bench/old_logprob_cost.py measures it). Without IG and with
    old_logprobs engine: the engine's own log-probs of the sampled tokens, no pass (exact only
    up to float noise; see TrainSettings.old_logprobs)."""
    cfg, backend = run.cfg, run.backend
    B = batch.input_ids.shape[0]
    if not cfg.method.info_gain.enabled and cfg.old_logprobs == "engine":
        # the sampled tokens' own log-probs (0 elsewhere, as the loss masks them)
        return torch.where(batch.loss_mask.bool(), batch.rollout_logprobs, 0.0), None, {}
    gold_BP, ig_stats = None, {}
    if cfg.method.info_gain.enabled:
        mine = list(range(backend.rank, B, backend.world_size))
        with clock("info_gain"):
            values, _, stats = score_gold_logprobs(
                backend.unwrapped,
                [(trajs[b].token_ids(), trajs[b].probe_points()) for b in mine],
                [build_probe(run.tok, trajs[b].golden_answers[0],
                             cfg.method.info_gain.probe_template) for b in mine], method="kv",
                batch_size=cfg.ig_batch_size, token_logprobs=False)
            gold: list = [None] * B
            ig_stats = defaultdict(float)
            for rows, part_values, part_stats in backend.all_gather_object(
                    (mine, values, stats)):
                for b, v in zip(rows, part_values, strict=True):
                    gold[b] = v
                for k, v in part_stats.items():
                    ig_stats[k] += v
            gold_BP = gold_logprob_matrix(gold)
    with clock("old_logprob"):
        mine, old_BL = update_logprobs(backend, batch, cfg.schedule, seed=seed)
        return _gather_rows(backend, old_BL, mine), gold_BP, dict(ig_stats)


def reference_logprobs(run: Run, batch: Batch, clock: Clock) -> torch.Tensor | None:
    """log π_ref of every token (B, L) for methods with a KL term, else None. The rows are
    split as the update splits them (`micro_batches`: the same number of micro-batches on
    every rank, which a ZeRO-3 reference needs) and gathered back."""
    if run.ref is None:
        return None
    backend, sched = run.backend, run.cfg.schedule
    B, L = batch.input_ids.shape
    lengths = dict(enumerate(batch.attention_mask.sum(1).tolist()))
    plan = micro_batches(lengths, list(range(B)), backend.world_size,
                         max_rows=sched.micro_batch_size,
                         max_tokens=sched.micro_batch_tokens)[backend.rank]
    with clock("ref_logprob"):
        mine, values = run.ref.logprobs(batch, plan, share_prefix=sched.share_prompt)
        ref_BL = torch.zeros(B, L)
        ref_BL[mine] = values
        return _gather_rows(backend, ref_BL, mine)


@dataclass(frozen=True)
class TokenAdvantages:
    """Step 7's result. adv_BK, clip_BK (B, K) float64: per turn (clip_BK None without
    adaptive clipping); ig_BK, ig_mask_BK (B, K): the IG each process turn got (None without
    IG); adv_BL, clip_BL (B, L) float32: the same per token, as the loss receives them."""

    adv_BK: torch.Tensor
    clip_BK: torch.Tensor | None
    ig_BK: torch.Tensor | None
    ig_mask_BK: torch.Tensor | None
    adv_BL: torch.Tensor
    clip_BL: torch.Tensor | None


def token_advantages(method: MethodConfig, batch: Batch, trajs: list[Trajectory],
                     gold_BP: torch.Tensor | None, tok) -> TokenAdvantages:
    """Information gain per turn from the gold log-probs (probe point t: after tool call t),
    the method's per-turn advantages and clip scales, and both on every sampled token of their
    turn. `tok` decodes GiGPO's anchor observations (unused by other estimators)."""
    ig_BK = ig_mask_BK = None
    if gold_BP is not None:
        ig_BC, ig_mask_BC = information_gain(
            gold_logprob_BK1=gold_BP, num_tool_calls_B=batch.tool_call.sum(1),
            value=method.info_gain.value, first_turn=method.info_gain.first_turn)
        ig_BK, ig_mask_BK = ig_by_turn(ig_BC=ig_BC, ig_mask_BC=ig_mask_BC,
                                       tool_call_BK=batch.tool_call, num_turns_B=batch.num_turns)
    estimator = method.advantage.estimator
    inputs = TurnInputs(
        reward_B=torch.tensor([float(t.reward) for t in trajs], dtype=torch.float64),
        group_B=batch.group_ids, num_turns_B=batch.num_turns, ig_BK=ig_BK,
        ig_mask_BK=ig_mask_BK,
        # GiGPO anchors: the question, then each turn's latest observation
        anchors=[[t.question_id] + [tok.decode(list(x.obs_ids)) for x in t.turns[:-1]]
                 for t in trajs] if estimator == "gigpo" else None,
        trees=[t.tree for t in trajs] if all(t.tree is not None for t in trajs) else None)
    adv_BK, clip_BK = turn_advantage_tensors(method, inputs)
    return TokenAdvantages(
        adv_BK=adv_BK, clip_BK=clip_BK, ig_BK=ig_BK, ig_mask_BK=ig_mask_BK,
        adv_BL=gather_turns(adv_BK.float(), batch.turn_id),
        clip_BL=None if clip_BK is None else gather_turns(clip_BK.float(), batch.turn_id,
                                                          fill=1.0))


# --------------------------------------------------------------------------------------------
# step 9: weights to the engines


def wake_and_sync(run: Run, clock: Clock) -> dict[str, float]:
    """The engine back from its sleep with the new weights: a vLLM engine's weights wake
    first, then `sync_engine`, then its KV cache, so the KV cache is not yet allocated while
    the sync needs memory (with train.weight_sync ipc the weights were dropped, and wake
    empty until the sync fills them). Returns `sync_engine`'s metrics."""
    if run.engine is not None and run.cfg.engine == "vllm":
        with clock("engine_wake"):
            run.engine.wake(("weights",))
    sync = sync_engine(run, clock)
    if run.engine is not None:
        with clock("engine_wake"):
            run.engine.wake()
    return sync


def sync_engine(run: Run, clock: Clock) -> dict[str, float]:
    """Every engine-hosting rank sends its own weights to its vLLM engine (the hf engine
    samples from the trained module itself: nothing to send), then compares the engine's
    weight checksum with that of what it sent (rollout/weight_checksum.py, exact and
    layout-free): an engine that kept old or wrong weights would sample from another policy,
    silently, and in bf16 the log-prob check (`engine_mismatch`) cannot tell it from rounding.

    Returns engine/sync_bytes, the bytes the transfers copied on their way (all ranks
    together; train.weight_sync: bytes, the whole state dict serialized; ipc, only what had
    to be moved into shared memory), and, with vLLM, engine/weights_match/rank<r>
    per engine-hosting rank and engine/weights_match (their minimum): 1 = the engine holds
    exactly its rank's weights. A mismatch stops training on every rank with an error naming
    the ranks: the samples would be from an unknown policy, and the newest checkpoint is from
    before it. Nothing is checked where the engine is gone after a stop request."""
    sent, check = 0.0, None
    vllm = run.cfg.engine == "vllm"
    if vllm and run.engine is not None:
        with clock("weight_sync"):
            state = run.backend.local_state_dict()
            sent = float(run.engine.update_weights(state))
        with clock("weight_check"):
            got = run.engine.weights_checksum()
            check = None if got is None else (state_checksum(state), got)
    out = {"engine/sync_bytes": float(run.backend.all_reduce_sum(sent))}
    if not vllm:
        return out
    checks = {r: c for r, c in enumerate(run.backend.all_gather_object(check)) if c is not None}
    for r, (want, got) in checks.items():
        out[f"engine/weights_match/rank{r}"] = float(want == got)
    if checks:
        out["engine/weights_match"] = min(v for k, v in out.items() if "/rank" in k)
    bad = {r: c for r, c in checks.items() if c[0] != c[1]}
    if bad:
        raise RuntimeError(
            "after the weight sync, the vLLM engine of rank(s) " + ", ".join(map(str, bad))
            + " does not hold that rank's weights (checksum engine != trainer: "
            + "; ".join(f"rank {r}: {g} != {w}" for r, (w, g) in bad.items())
            + "); its rollouts would come from other weights")
    return out


def engine_mismatch(backend, trajs: list[Trajectory], batch: Batch, old_BL: torch.Tensor
                    ) -> dict[str, float]:
    """max |log π_engine − log π_old| over the sampled tokens of each rank's trajectories. The
    engine that sampled them and the trainer that scores them hold the same weights
    (`sync_engine` checks that exactly), so this is their numerical difference: float noise in
    fp32 (~1e-6; more means a wrong engine), O(1e-2) in bf16, where it says nothing about the
    weights. Keys rollout/logprob_diff_max and rollout/logprob_diff_max/rank<r>."""
    diff_BL = torch.where(batch.loss_mask.bool(), (batch.rollout_logprobs - old_BL).abs(),
                          torch.zeros(()))
    out = {"rollout/logprob_diff_max": float(diff_BL.max())}
    by_rank: dict[int, float] = defaultdict(float)
    for b, t in enumerate(trajs):
        r = t.extra.get("rank", 0)
        by_rank[r] = max(by_rank[r], float(diff_BL[b].max()))
    for r in range(backend.world_size):
        if r in by_rank:
            out[f"rollout/logprob_diff_max/rank{r}"] = by_rank[r]
    return out


# --------------------------------------------------------------------------------------------
# step 10: metrics


def step_metrics(run: Run, trajs: list[Trajectory], batch: Batch, adv: TokenAdvantages,
                 update: UpdateLog, sampling: dict, ig_stats: dict, clock: Clock) -> dict:
    """One metrics.jsonl row: rewards, rollout shape, losses, advantages/IG by turn, seconds
    per stage and throughput."""
    metrics = {**rollout_metrics(trajs, sampling), **update.metrics(),
               **outcome_metrics(trajs, run.tok, run.questions, "train/outcome"),
               **turn_metrics(adv, batch.num_turns),
               "optim/lr": float(run.scheduler.get_last_lr()[0]),
               "time/step": clock.elapsed()}
    if ig_stats:
        metrics["ig/extra_token_ratio"] = (ig_stats["ig_tokens"]
                                           / max(1, ig_stats["trajectory_tokens"]))
    metrics.update({f"time/{k}": v for k, v in clock.times.items()})
    sampled = sum(len(x.action_ids) for t in trajs for x in t.turns)
    metrics["throughput/rollout_tokens_per_s"] = sampled / max(
        1e-9, clock.times["rollout"] + clock.times["retrieval"])
    metrics["throughput/update_tokens_per_s"] = float(batch.attention_mask.sum()) \
        * run.cfg.schedule.ppo_epochs / max(1e-9, clock.times["update"])
    return metrics


def rollout_metrics(trajs: list[Trajectory], sampling: dict) -> dict:
    """Rewards, EM, format failures, tool calls, lengths, stops and group spread."""
    calls = [t.num_tool_calls for t in trajs]
    groups: dict = defaultdict(set)
    for t in trajs:
        groups[t.group_id].add(t.reward)
    out = {
        "train/reward": float(np.mean([t.reward for t in trajs])),
        "train/em": float(np.mean([t.extra["em"] for t in trajs])),
        "train/format_fail": float(np.mean([not t.extra["format_ok"] for t in trajs])),
        "rollout/trajectories": len(trajs),
        "rollout/tool_calls": float(np.mean(calls)),
        "rollout/response_tokens": float(np.mean([t.response_length() for t in trajs])),
        "rollout/obs_tokens": float(np.mean([sum(len(x.obs_ids) for x in t.turns)
                                            for t in trajs])),
        "rollout/truncated": float(np.mean([t.turns[-1].stop in ("length", "max_tokens")
                                           for t in trajs])),
        "rollout/zero_variance_groups": sum(len(r) <= 1 for r in groups.values())
        / max(1, len(groups)),
        "rollout/gen_batches": sampling["gen_batches"],
        "rollout/retrieval_calls": sampling["retrieval_calls"],
        # share of the step's observations whose passages rollout.max_obs_tokens cut
        "rollout/obs_cut": sampling["obs_cut"],
        **{f"rollout/{k}": sampling[k] for k in ROLLOUT_TIMES if k in sampling},
        "rollout/entropy": float(np.mean([x.entropy for t in trajs for x in t.turns])),
    }
    for c in range(max(calls) + 1):
        out[f"rollout/tool_calls_dist/{c}"] = calls.count(c) / len(calls)
    for stop, n in Counter(t.turns[-1].stop for t in trajs).items():
        out[f"rollout/stop/{stop}"] = n / len(trajs)
    return out


def turn_metrics(adv: TokenAdvantages, num_turns_B: torch.Tensor) -> dict:
    """Advantage (mean/std/min/max) and IG (mean/std) by turn position, over the trajectories
    that have that turn (IG: that have an IG there)."""
    out = {}
    for k in range(adv.adv_BK.shape[1]):
        col = adv.adv_BK[num_turns_B > k, k].numpy()
        if len(col):
            out.update({f"adv/turn{k}/mean": float(np.mean(col)),
                        f"adv/turn{k}/std": float(np.std(col)),
                        f"adv/turn{k}/min": float(np.min(col)),
                        f"adv/turn{k}/max": float(np.max(col))})
        if adv.ig_BK is not None:
            ig = adv.ig_BK[adv.ig_mask_BK[:, k], k].double().numpy()
            if len(ig):
                out[f"ig/turn{k}/mean"] = float(np.mean(ig))
                out[f"ig/turn{k}/std"] = float(np.std(ig))
    return out


def rollout_records(tok, trajs: list[Trajectory], adv_BK: torch.Tensor,
                    num_turns_B: torch.Tensor) -> list[dict]:
    """rollouts.jsonl rows: per trajectory its question id, group, index in the group, reward,
    per-turn advantages and turns (text, stop, query)."""
    seen: Counter = Counter()
    out = []
    for b, t in enumerate(trajs):
        turns = [{"turn": k, "stop": x.stop, "query": x.query,
                  "text": tok.decode(list(x.action_ids), skip_special_tokens=True)}
                 for k, x in enumerate(t.turns)]
        out.append({"question_id": t.question_id, "group": str(t.group_id),
                    "index": seen[t.group_id],
                    "reward": float(t.reward),
                    "advantages": adv_BK[b, : int(num_turns_B[b])].tolist(), "turns": turns})
        seen[t.group_id] += 1
    return out


# --------------------------------------------------------------------------------------------
# helpers


class Clock:
    """Seconds per named stage of a step (a stage may run several times and adds up)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.times: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.times[stage] += time.perf_counter() - t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _run_folder_lock(cfg: TrainConfig):
    """One writer per run folder: rank 0 holds its lock for the whole job (a second job on the
    same cell fails at once with the holder's pid and host; a2tgpo/ops/lock.py)."""
    rank = int(launcher_env()["RANK"]) if cfg.backend == "deepspeed" else 0
    return folder_lock(cfg.run_dir, "run folder") if rank == 0 else contextlib.nullcontext()


def _resume_point(cfg: TrainConfig, identity: dict | None, rank: int, distributed: bool
                  ) -> Path | None:
    """The checkpoint every rank resumes from: rank 0 picks the newest intact one (a damaged
    one is moved aside with a warning, checkpoint.resume_checkpoint), or none where it was
    made from another config or other inputs (the old run is archived, lineage.py), and tells
    the others."""
    ckpt = resume_checkpoint(cfg.run_dir) if rank == 0 else None
    if ckpt is not None:
        saved = json.loads((ckpt / "meta.json").read_text())["trainer_state"].get(IDENTITY_KEY)
        if saved is None:
            log.warning("%s records no config (saved by an older a2tgpo): resuming it without "
                        "checking that this job's config and inputs are the ones it was "
                        "trained from", ckpt)
        elif changes := identity_changes(saved, identity):
            run_dir, stamp = Path(cfg.run_dir), archive_stamp()
            dest = (archive_dir(cfg.results_dir, cfg.cell, stamp) if cfg.cell
                    else run_dir.with_name(f"{run_dir.name}.superseded-{stamp}"))
            archive_superseded(run_dir, dest, saved, changes)
            log.warning("%s was trained from another config or other inputs; the old run is "
                        "moved to %s and this one starts at step 0. What changed:\n  %s",
                        ckpt, dest, "\n  ".join(changes))
            ckpt = None
    if distributed:
        import torch.distributed as dist

        box = [None if ckpt is None else str(ckpt)]
        dist.broadcast_object_list(box, src=0)
        ckpt = None if box[0] is None else Path(box[0])
    return ckpt


def _process(cfg: TrainConfig) -> tuple[int, str, EnginePlacement]:
    """(rank, torch device, engine placement) of this process; joins the process group under
    DeepSpeed."""
    if cfg.backend == "deepspeed":
        info = init_distributed()
        placement = engine_placement(rank=info.rank, local_rank=info.local_rank,
                                     world_size=info.world_size,
                                     local_world_size=info.local_world_size, tp=cfg.rollout_tp)
        return info.rank, str(info.device), placement
    # one process: one engine, tensor parallel over the first rollout_tp GPUs
    return 0, resolve_device(cfg.device), EnginePlacement(
        hosts_engine=True, group=0, n_groups=1, devices=tuple(range(cfg.rollout_tp)))


def _epochs(cfg: TrainConfig, n_questions: int) -> int:
    """Epochs of the data order: enough for every step's generation batches, plus one."""
    dapo, sched = cfg.method.dapo, cfg.schedule
    per_step = sched.prompts_per_step
    if dapo.dynamic_sampling:
        per_step *= dapo.gen_batch_multiplier * max(1, dapo.max_num_gen_batches
                                                    if dapo.gen_batch_multiplier > 1 else 1)
    return math.ceil(sched.steps * per_step / max(1, n_questions)) + 1


def _close(run: Run) -> None:
    # a vLLM engine's processes ignore the job's stop signals: the trainer stops them
    if run.cfg.engine == "vllm" and run.engine is not None:
        run.engine.close()
    if run.ref is not None:
        run.ref.close()
    run.backend.close()
    # leave the process group before exiting: gloo's destructors, run at interpreter exit
    # while another rank still holds the group, can abort the process (status 134)
    shutdown_distributed()


def _make_backend(cfg: TrainConfig, model, optimizer):
    if cfg.backend == "single":
        return SingleBackend(model, optimizer, cfg.optim.grad_clip)
    return DeepSpeedBackend(model, optimizer, zero_stage=cfg.zero_stage,
                            grad_clip=cfg.optim.grad_clip,
                            micro_batch_size=cfg.schedule.micro_batch_size)


def _tracker(cfg: TrainConfig) -> Tracker:
    run_dir = Path(cfg.run_dir)
    a = cfg.method.advantage
    tags = {"method": cfg.method.id, "backbone": cfg.backbone.id, "seed": str(cfg.seed),
            "beta": format_value(a.beta), "gamma": format_value(a.gamma), "cell": cfg.cell,
            "stage": "train", STUDY_RUN_TAG: study_run_name(cfg.study)}
    return Tracker(run_dir, cfg.tracking, study=cfg.study, run_name=run_name(cfg),
                   tags=tags, params=cfg, config_file=run_dir / "config.yaml",
                   results_dir=cfg.results_dir)


def run_name(cfg: TrainConfig) -> str:
    """The MLflow run name: method, β and seed first (the cell path is the `cell` tag)."""
    try:
        return Cell.parse(cfg.cell).display_name
    except ValueError:  # a run outside the grid (a sweep trial's or a hand-made config)
        return (f"{cfg.method.id} β={format_value(cfg.method.advantage.beta)} seed {cfg.seed}"
                f" · {cfg.backbone.id}")


def _write_config(cfg: TrainConfig, path: Path) -> None:
    """The resolved config beside the results; left untouched when it already says the same
    (the DAG's cell config is this file, and rewriting it would look like a new input)."""
    if not path.exists() or path.read_text() != dump_yaml(to_dict(cfg)):
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

    def log_artifact(self, path, artifact_path=None) -> None:
        pass

    def log_inputs(self, datasets) -> None:
        pass


def _gather(backend, items: list) -> list:
    """Concatenate every rank's list, in rank order (the same list on every rank)."""
    return [x for part in backend.all_gather_object(items) for x in part]


def _gather_rows(backend, x: torch.Tensor, mine: list[int]) -> torch.Tensor:
    """Rows `mine` of x come from this rank; after the gather every rank has all rows."""
    if backend.world_size == 1:
        return x
    out = x.clone()
    for rows, vals in backend.all_gather_object((mine, x[mine])):
        out[rows] = vals
    return out
