"""The update on real toy rollouts: computed / real tokens and seconds per step, the update as
it was before chunked log-probs and token-budget micro-batches against the update today.

The toy is built here as the pipeline builds it from config/config.yaml (world, toy backbone,
MiniLM index, prepared data, the warm-start SFT), in a work folder (a temporary one unless
--work names one; a finished build there is reused). The a2tgpo cell of that config is then
started with `rl.start_run` and, for each of --steps steps, the recipe's steps 1-7 run as in
`rl.train_step` (`sample_groups` with the step's seed, `collate`, `old_logprobs`,
`reference_logprobs`, `token_advantages`): the rows, lengths, log-probs and advantages of the
update are those of a real toy step from the warm-started policy (no update runs between the
steps, so every step samples from that policy).

Variants of step 8, `update.update_policy` on the same batches with the config's schedule
(prompts_per_step, mini_batch_prompts, micro_batch_size, ppo_epochs, one process):
  before   micro_batch_tokens 0 (micro_batch_size rows per micro-batch, rows r::world in
           order), every micro-batch run over all columns of the step's batch (collate pads
           to the step's longest row) and its log-probs from one full-vocabulary log-softmax
           of the whole micro-batch, kept for backward: the update before token budgets and
           chunking. Today's code cuts every micro-batch to its own longest row and has no
           setting for either, so two functions of a2tgpo.train.update are swapped for the
           run: `token_logprobs` is called for all columns and its result sliced back to the
           micro-batch's length (the columns past it are padding with loss mask 0, so the loss
           is unchanged), and `chunked_logprobs` becomes that single log-softmax.
  rows     today's code with micro_batch_tokens 0 (the toy default): micro_batch_size rows
           per micro-batch, each cut to its own longest row; chunks of DEFAULT_CHUNK_TOKENS.
  budget   today's code with micro_batch_tokens = each --budget: rows sorted by length and
           packed under the budget (`update.micro_batches`), each cut to its longest row.
Computed tokens are rows x columns of every forward the update makes (counted on the calls
themselves, and checked equal to what `micro_batches` plans); real tokens are the rows'
lengths. Seconds: every variant runs on every step's batch from the same weights and optimizer
state (restored before each call), the variants interleaved in each repetition, after one
untimed pass (the token count and the loss check); the median over repetitions of the mean
seconds per step, with the toy's training threads (train.threads). Peak memory: each variant
once more in its own process, peak resident memory of the update minus the resident memory
before it (/proc/self/clear_refs resets the peak). Grad norm diff: the largest relative
difference of an update's gradient norm from before's (the same loss: round-off only).

    python bench/toy_update.py [--quick] [--steps 4] [--reps 5] [--budget 1024 2048 4096]
                               [--work DIR]

The SFT dominates a fresh build (about 160 s on 2 idle cores), the measurement takes about 6
minutes more; --work keeps the build for the next run, and results/toy after `snakemake` is a
finished one. --quick: a small world and an
untrained backbone (no SFT), one step, two repetitions, no memory processes: the code paths
only, its numbers are not the toy's. Run from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
METHOD = "a2tgpo"
BATCHES = "batches.pt"


# --------------------------------------------------------------------------------------------
# the toy, built as the pipeline builds it


def build_toy(work: Path, quick: bool, scratch: Path):
    """World -> backbone -> index -> data -> SFT under `work`, in the pipeline's layout
    (results/toy/...), each stage skipped where its files exist; returns the a2tgpo cell's
    TrainConfig (run folder under `scratch`) and the study's CPU threads per training job."""
    from a2tgpo.algo.methods import get_method
    from a2tgpo.cell import Cell
    from a2tgpo.config import dump_config
    from a2tgpo.data.qa import prepare_data
    from a2tgpo.data.world import QASetSpec, write_world
    from a2tgpo.grid import cell_config
    from a2tgpo.model.toy import write_toy_backbone
    from a2tgpo.retrieval.docstore import DocStore
    from a2tgpo.retrieval.encoders import Encoder
    from a2tgpo.retrieval.index import build_index, encode_shard
    from a2tgpo.study import load_study
    from a2tgpo.tracking import TrackingConfig
    from a2tgpo.train import sft

    study = load_study(REPO / "config" / "config.yaml")
    world, backbone, dev_size = study.world, study.toy_backbone, study.data.dev_size
    if quick:  # the training tests' sizes (tests/train/conftest.py)
        world = dataclasses.replace(
            world, countries=4, cities=8, people=30, films=12, bands=6, companies=8,
            distractors=10, qa_sets=(
                QASetSpec("toy_nq", "single_hop", {"train": 40, "dev": 6}, {"single": 1.0}),
                QASetSpec("toy_hotpotqa", "multi_hop", {"train": 20},
                          {"bridge": 0.8, "comparison": 0.2})))
        backbone = dataclasses.replace(backbone, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2)
        dev_size = 6
    qa = str(work / "world" / "qa")
    data = dataclasses.replace(
        study.data, dev_size=dev_size,
        train=tuple(dataclasses.replace(s, repo=qa) for s in study.data.train),
        test=(dataclasses.replace(study.data.test[0], repo=qa),))
    retrieval = dataclasses.replace(
        study.retrieval, index=dataclasses.replace(study.retrieval.index, num_shards=1))
    corpus, index = work / "world" / "corpus.jsonl", work / "index" / "dense.faiss"

    def make_index():
        docs, emb = DocStore(corpus), work / "index" / "emb.npy"
        emb.parent.mkdir(parents=True, exist_ok=True)
        encode_shard(docs, Encoder(retrieval.encoder), 0, 1, emb, retrieval.index.chunk_size)
        build_index([emb], retrieval.index, len(docs), index, {})

    def make_sft():
        dump_config(study.sft, scratch / "sft.yaml")
        sft.main(scratch / "sft.yaml", [], backbone_dir=work / "backbone",
                 world_dir=work / "world", corpus=corpus, index=index, out_dir=work / "sft",
                 section=None, holdout=work / "data" / "dev.parquet")

    stages = [
        ("world", work / "world" / "summary.json", lambda: write_world(world, work / "world")),
        ("backbone", work / "backbone" / "config.json",
         lambda: write_toy_backbone(backbone, work / "world", work / "backbone")),
        ("index", index, make_index),
        ("data", work / "data" / "summary.json", lambda: prepare_data(data, work / "data")),
    ]
    if not quick:  # quick: the untrained backbone is the policy (code paths only)
        stages.append(("sft", work / "sft" / "config.json", make_sft))
    for name, done, make in stages:  # each stage's last file marks it complete
        if not done.exists():
            t0 = time.perf_counter()
            make()
            print(f"built {name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    beta = get_method(METHOD, study.methods_dir).advantage.beta
    cfg = cell_config(
        Cell("toy", METHOD, beta, 1), study="toy_update", results_root=str(scratch),
        backbone=dataclasses.replace(study.backbone("toy"),
                                     path=str(work / ("backbone" if quick else "sft"))),
        train=study.train, methods_dir=study.methods_dir, retrieval=retrieval,
        tracking=TrackingConfig(mlflow=False), train_file=str(work / "data" / "train.parquet"),
        dev_file=str(work / "data" / "dev.parquet"), corpus=str(corpus), index=str(index))
    return cfg, study.train.threads


def step_batches(run, steps: int) -> list[tuple[int, object]]:
    """(seed, UpdateBatch) of `steps` steps: the recipe's steps 1-7 as rl.train_step runs them."""
    from a2tgpo.rollout.trajectory import collate
    from a2tgpo.train.rl import (
        Clock,
        old_logprobs,
        reference_logprobs,
        sample_groups,
        token_advantages,
    )
    from a2tgpo.train.update import UpdateBatch

    out = []
    for step in range(steps):
        seed = run.cfg.seed * 1_000_003 + step
        clock = Clock()
        trajs, _ = sample_groups(run, seed, clock)
        batch = collate(trajs, run.tok.pad_token_id)
        old_BL, gold_BP, _ = old_logprobs(run, batch, trajs, clock, seed=seed)
        ref_BL = reference_logprobs(run, batch, clock)
        adv = token_advantages(run.cfg.method, batch, trajs, gold_BP, run.tok)
        out.append((seed, UpdateBatch(batch, old_BL, adv.adv_BL, ref_BL, adv.clip_BL)))
    return out


# --------------------------------------------------------------------------------------------
# the variants


def variants(budgets: list[int]) -> list[tuple[str, int]]:
    """(name, micro_batch_tokens); "before" also swaps in the old log-prob pass."""
    return [("before", 0), ("rows", 0)] + [(f"budget {b}", b) for b in budgets]


def full_logprobs(*, hidden_NH, project, target_N, with_entropy=False, chunk_tokens=None):
    """The log-prob pass before chunking: one log-softmax over every token at once, (N, V)
    float32, kept for backward (no recomputation); chunk_tokens is ignored."""
    from a2tgpo.algo.logprobs import entropy_from_logprobs

    logp_NV = torch.log_softmax(project(hidden_NH).float(), dim=-1)
    lp = logp_NV.gather(-1, target_N[:, None]).squeeze(-1)
    return lp, (entropy_from_logprobs(logp_BTV=logp_NV) if with_entropy else None)


@contextlib.contextmanager
def update_code(name: str, shapes: list | None = None):
    """The update's code for variant `name`; `shapes` (when given) receives (rows, columns) of
    every forward of the update."""
    from a2tgpo.train import update

    token_logprobs, chunked = update.token_logprobs, update.chunked_logprobs
    before = name == "before"

    def counted(model, batch, rows, **kw):
        # before: all columns of the step's batch, as before the per-micro-batch cut
        length = kw.pop("length", None) if before else None
        lp, ent = token_logprobs(model, batch, rows, **kw)
        if shapes is not None:
            shapes.append(tuple(lp.shape))
        if before:
            lp, ent = lp[:, :length], (None if ent is None else ent[:, :length])
        return lp, ent

    update.token_logprobs = counted
    if before:
        update.chunked_logprobs = full_logprobs
    try:
        yield
    finally:
        update.token_logprobs, update.chunked_logprobs = token_logprobs, chunked


def run_update(run, seed: int, data, tokens: int, name: str, shapes=None):
    """update_policy on one step's batch with the variant's settings; -> UpdateLog."""
    from a2tgpo.train.update import update_policy

    cfg = run.cfg
    schedule = dataclasses.replace(cfg.schedule, micro_batch_tokens=tokens)
    with update_code(name, shapes):
        return update_policy(run.backend, run.scheduler, data, cfg.method.loss, schedule,
                             seed=seed, norm_length=cfg.rollout.max_response_tokens)


def planned_tokens(seed: int, data, schedule, tokens: int, name: str) -> tuple[int, int]:
    """(computed, real) tokens of the update's micro-batches as `update.micro_batches` plans
    them, mini-batches formed as update_policy forms them (one process)."""
    import random

    from a2tgpo.train.update import micro_batches

    b = data.batch
    L = b.input_ids.shape[1]
    lengths = dict(enumerate(b.attention_mask.sum(1).tolist()))
    groups = list(dict.fromkeys(b.group_ids))
    rng = random.Random(seed)
    computed = real = 0
    for _ in range(schedule.ppo_epochs):
        order = groups[:]
        rng.shuffle(order)
        for m in range(0, len(order), schedule.mini_batch_prompts):
            chosen = set(order[m: m + schedule.mini_batch_prompts])
            rows = [r for r, g in enumerate(b.group_ids) if g in chosen]
            for mb in micro_batches(lengths, rows, 1, max_rows=schedule.micro_batch_size,
                                    max_tokens=tokens)[0]:
                width = L if name == "before" else max(lengths[r] for r in mb)
                computed += len(mb) * width
                real += sum(lengths[r] for r in mb)
    return computed, real


class State:
    """The weights, optimizer and scheduler state to restore before every timed update."""

    def __init__(self, run) -> None:
        self.run = run
        self.model = copy.deepcopy(run.backend.unwrapped.state_dict())
        self.optim = copy.deepcopy(run.optimizer.state_dict())
        self.sched = copy.deepcopy(run.scheduler.state_dict())

    def restore(self) -> None:
        self.run.backend.unwrapped.load_state_dict(self.model)
        self.run.optimizer.load_state_dict(copy.deepcopy(self.optim))
        self.run.scheduler.load_state_dict(self.sched)


# --------------------------------------------------------------------------------------------
# peak memory, one variant per process


def _rss_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key}")


def child(scratch: Path, name: str, tokens: int) -> None:
    from a2tgpo.config import load_config
    from a2tgpo.train.config import TrainConfig
    from a2tgpo.train.rl import start_run

    saved = torch.load(scratch / BATCHES, weights_only=False)
    torch.set_num_threads(saved["threads"])
    run = start_run(load_config(TrainConfig, saved["config"]))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # peak resident memory := resident memory now
    base = _rss_mb("VmRSS")
    for seed, data in saved["batches"]:
        run_update(run, seed, data, tokens, name)
    print(json.dumps({"peak_mb": _rss_mb("VmHWM") - base}))


def peak_mb(scratch: Path, name: str, tokens: int) -> float:
    cmd = [sys.executable, __file__, "--child", name, str(tokens), str(scratch)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_mb"]


# --------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small untrained toy, one step, no memory processes: code paths only")
    ap.add_argument("--steps", type=int, default=None, help="steps' batches (default 4; quick 1)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions (default 5; quick 2)")
    ap.add_argument("--budget", type=int, nargs="*", default=[1024, 2048, 4096],
                    help="micro_batch_tokens values")
    ap.add_argument("--work", type=Path, default=None,
                    help="the toy's folder, kept and reused (default: a temporary one); "
                    "results/toy after `snakemake` holds a finished one")
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "TOKENS", "SCRATCH"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(Path(a.child[2]), a.child[0], int(a.child[1]))
        return
    with tempfile.TemporaryDirectory() as scratch:
        work = a.work or Path(scratch) / "toy"
        work.mkdir(parents=True, exist_ok=True)
        report(work, Path(scratch), a.quick, a.steps or (1 if a.quick else 4),
               a.reps or (2 if a.quick else 5), a.budget)


def report(work: Path, scratch: Path, quick: bool, steps: int, reps: int,
           budgets: list[int]) -> None:
    from a2tgpo.train.rl import start_run

    t0 = time.perf_counter()
    cfg, threads = build_toy(work, quick, scratch)
    run = start_run(cfg)
    batches = step_batches(run, steps)
    print(f"toy and {steps} step(s) of rollouts in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    torch.set_num_threads(threads)  # the toy's training jobs' setting
    sched = cfg.schedule
    state = State(run)
    names = variants(budgets)

    # tokens: planned by micro_batches, and counted on the update's forwards (warm-up rep)
    planned, logs = {}, {}
    for name, tokens in names:
        shapes: list = []
        planned[name] = [sum(x) for x in zip(*(planned_tokens(s, d, sched, tokens, name)
                                               for s, d in batches), strict=True)]
        logs[name] = []
        for seed, data in batches:
            state.restore()
            logs[name].append(run_update(run, seed, data, tokens, name, shapes))
        counted = sum(r * c for r, c in shapes)
        if counted != planned[name][0]:
            raise AssertionError(f"{name}: the update computed {counted} tokens, "
                                 f"micro_batches planned {planned[name][0]}")
    # seconds: variants interleaved in every repetition
    seconds: dict[str, list[float]] = {name: [] for name, _ in names}
    for _ in range(reps):
        for name, tokens in names:
            total = 0.0
            for seed, data in batches:
                state.restore()
                start = time.perf_counter()
                run_update(run, seed, data, tokens, name)
                total += time.perf_counter() - start
            seconds[name].append(total / len(batches))
    peaks = {}
    if not quick:
        torch.save({"config": str(Path(cfg.run_dir) / "config.yaml"), "threads": threads,
                    "batches": batches}, scratch / BATCHES)
        peaks = {name: peak_mb(scratch, name, tokens) for name, tokens in names}
    print(f"measured in {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    lens = torch.cat([d.batch.attention_mask.sum(1) for _, d in batches]).float()
    real = planned["before"][1]
    med = {name: statistics.median(v) for name, v in seconds.items()}
    norms = lambda name: [g for log in logs[name] for g in log.grad_norms]  # noqa: E731
    print(f"toy update ({'quick' if quick else 'config/config.yaml'}, method {METHOD}): "
          f"{steps} step(s) of {lens.numel() // steps} rows ({sched.prompts_per_step} prompts "
          f"x {cfg.method.rollout.n}), mini-batches of {sched.mini_batch_prompts} prompts, "
          f"micro_batch_size {sched.micro_batch_size}, {torch.get_num_threads()} thread(s), "
          f"median of {reps} repetitions")
    print(f"row lengths: mean {lens.mean():.0f}, min {lens.min():.0f}, max {lens.max():.0f}; "
          f"{real:,} real tokens; before's gradient norms: mean "
          f"{statistics.mean(norms('before')):.3g} over {len(norms('before'))} updates")
    print(f"{'variant':<14}{'computed/real':>15}{'s/step':>10}{'time/before':>13}"
          f"{'peak MB':>10}{'peak/before':>13}{'grad norm diff':>16}")
    for name, _ in names:
        # the same loss: the gradient norms of every update agree with before's
        diff = max(abs(a - b) / max(abs(b), 1e-12)
                   for a, b in zip(norms(name), norms("before"), strict=True))
        mem = (f"{peaks[name]:>10.1f}{peaks[name] / peaks['before']:>13.2f}" if peaks
               else f"{'-':>10}{'-':>13}")
        print(f"{name:<14}{planned[name][0] / real:>15.2f}{med[name]:>10.3f}"
              f"{med[name] / med['before']:>13.2f}{mem}{diff:>16.1e}")
    after = ", ".join(f"{b} tokens {med[f'budget {b}'] / med['before']:.2f}" for b in budgets)
    print(f"summary: computed/real {planned['before'][0] / real:.2f} before, "
          f"{min(planned[n][0] for n, _ in names[1:]) / real:.2f} at best after; update "
          f"time after/before: rows {med['rows'] / med['before']:.2f}, {after}")


if __name__ == "__main__":
    main()
