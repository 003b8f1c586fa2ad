"""Test-set evaluation of a grid cell's checkpoint(s): greedy rollouts, EM/F1, group averages.

The rollouts and scores are those of training's validation, by the same functions
(`a2tgpo.train.episodes.rollout(..., greedy=True)` and `episodes.score(..., training=False)`, with
the same seed), so a dev EM and a test EM are measured the same way. The policy is the
checkpoint's HF model directory, loaded through `a2tgpo.model.backbone` with the cell's backbone
config pointed at it (dtype, chat template and thinking switch as in training); retriever and
search tool are built from the cell's config as training builds them.

Throughput: the questions of ALL test sets go through the agent loop together, `chunk`
questions per rollout call, so every wave of every call is one large engine batch (the hf
engine splits it into `max_batch` rows per forward; vLLM schedules it continuously).

Outputs of one checkpoint, in `<out>/` (the directory is replaced atomically as a whole, so a
reader never sees a mix of two evaluations; summary.json is the completeness marker):

    <dataset>.json              {"dataset", "group", "n", "em", "f1", "format_ok", "tool_calls",
                                 "step", "checkpoint", "criterion", "failed", "outcomes"} (means
                                 over the questions; failed: questions that got no rollout;
                                 outcomes: the share of each outcome)
    <dataset>.predictions.jsonl one row per question, file order: {"id", "question",
                                 "golden_answers", "prediction" (extracted answer or null),
                                 "em", "f1", "format_ok", "tool_calls", "queries", "stop",
                                 "outcome" (a2tgpo/rollout/failures.py: why it failed, or one
                                 of ROW_FAILURES), "error" (null, or why it got no rollout)}
    summary.json                {"step", "checkpoint", "criterion", "label", "failed",
                                 "datasets": {name: {"n", "em", "f1", "group", "failed"}},
                                 "groups": {group: {"n", "em", "f1"}, ..., "all": {...}}}
    tracking/metrics.jsonl      what was logged to the cell's MLflow run (a2tgpo.tracking)

One question never takes the evaluation down. Before any rollout, each prompt is measured
against the prompt budget (`train.episodes.prompt_budget`); a longer one is not rolled out
(outcome "prompt_too_long"). A rollout call that raises is split in halves until the questions
that raise stand alone (outcome "error", the exception in "error"); a stop request, a dead
vLLM engine or an unreachable retriever still ends the evaluation, and so does a run where
every question raised (nothing about it is one question's). A failed question is logged with
its file, row and id, has an empty prediction and EM/F1 0, and counts in every mean (the
papers' averages are over all questions); "failed" counts them.

`<dataset>` is the parquet file's stem; its group is the `group` column of its rows (one group
per file). Group averages are SAMPLE-WEIGHTED, as the papers define them (A2TGPO §5.2): the sum
of per-question EM over the group's datasets divided by their number of questions, so a large
dataset weighs more than a small one. "all" pools every question. `checkpoint` is relative to
the cell directory (as in best.json); `criterion`/`label` come from best.json (null / "step N"
for `--all-checkpoints`, which writes one such directory per checkpoint:
`<out>/step_NNNNNN/`, the input of `a2tgpo select --criterion test_avg`).

Metrics go to the cell's MLflow run (`Tracker.attach`): `test/<dataset>/{em,f1}` and
`test/<group>/{em,f1}` at the selected step for `--best`; `test_by_checkpoint/...` at each
checkpoint's step for `--all-checkpoints` (a separate name, so the run's latest `test/...`
values stay those of the selected checkpoint). The test sets are the run's dataset inputs
(context test); for `--best` the run also gets, as artifacts under eval/, the files above
(predictions, per-set records, summary.json) and best.json, the selection they evaluate.
A tracking failure never fails evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from a2tgpo.config import load_config
from a2tgpo.data.qa import dataset_input, load_split
from a2tgpo.eval.select import complete_checkpoints, read_best, step_dir_name
from a2tgpo.io import atomic_path, atomic_write_json, atomic_write_jsonl
from a2tgpo.model.backbone import load_model, load_tokenizer
from a2tgpo.ops.preemption import StopRequested
from a2tgpo.progress import progress_bar
from a2tgpo.retrieval.http import RetrieverUnavailable
from a2tgpo.retrieval.retriever import build_retriever
from a2tgpo.rollout.agent import Question
from a2tgpo.rollout.failures import OUTCOMES, label_outcomes
from a2tgpo.rollout.trajectory import Trajectory
from a2tgpo.rollout.vllm_engine import EngineDead
from a2tgpo.tracking import SUMMARY_FILE, Tracker
from a2tgpo.train.config import TrainConfig
from a2tgpo.train.episodes import (
    GREEDY_SEED,
    make_engine,
    prompt_budget,
    prompt_lengths,
    question_of,
    resolve_device,
    rollout,
    score,
    search_tool,
    too_long,
)
from a2tgpo.train.memory import job_peak

log = logging.getLogger(__name__)

# questions per rollout call: large waves; also the granularity of the progress bar
DEFAULT_CHUNK = 1024
# rows per forward of the hf engine on CPU. Every wave re-reads each row's whole context and
# pads a batch to its longest row, so on CPU smaller batches waste less: the warm-started toy
# policy on the toy test sets (500 questions, 1 thread; process CPU time, loading included)
# took 38-42 s at 16 or 32 rows, 44 s at 64 and 66 s at 256. On GPU the engine's own default
# is kept.
CPU_MAX_BATCH = 32
TRACKING_SUBDIR = "tracking"
EVIDENCE_DIR = "eval"  # where the run's artifacts of an evaluation go
ALL = "all"
# outcomes of a question that got no rollout (the others: a2tgpo/rollout/failures.py)
ROW_FAILURES = ("prompt_too_long", "error")
# failures that are no single question's: they end the evaluation
_FATAL = (StopRequested, EngineDead, RetrieverUnavailable)


@dataclass(frozen=True)
class EvalDataset:
    """One prepared test file: its name (the file stem), group and rows (`load_split` dicts)."""

    name: str
    group: str
    path: Path
    rows: list[dict]


def load_test_sets(paths: Sequence[str | Path]) -> list[EvalDataset]:
    """Read prepared test parquet files; checks names, groups and ids.

    Raises ValueError naming the file (and row) when a file is empty, a row has no group,
    a file mixes groups, a group is called "all", two files share a stem, or an id repeats
    across files (questions are matched to predictions by id).
    """
    if not paths:
        raise ValueError("no test files given")
    sets: list[EvalDataset] = []
    seen_ids: dict[str, Path] = {}
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: test file not found")
        rows = load_split(p)
        if not rows:
            raise ValueError(f"{p}: no questions")
        for i, r in enumerate(rows):
            if not (r.get("group") or "").strip():
                raise ValueError(f"{p}: row {i} (id {r['id']!r}) has no group (the `group` "
                                 "column names the average it counts in, e.g. multi_hop)")
            if r["id"] in seen_ids:
                raise ValueError(f"{p}: row {i}: id {r['id']!r} also in {seen_ids[r['id']]}")
            seen_ids[r["id"]] = p
        groups = sorted({r["group"] for r in rows})
        if len(groups) > 1:
            raise ValueError(f"{p}: rows of several groups {groups}; a test set belongs to "
                             "one group")
        if groups[0] == ALL:
            raise ValueError(f"{p}: group {ALL!r} is reserved for the average over all sets")
        if any(s.name == p.stem for s in sets):
            raise ValueError(f"{p}: dataset name {p.stem!r} (the file stem) given twice")
        sets.append(EvalDataset(p.stem, groups[0], p, rows))
    return sets


# --------------------------------------------------------------------------------------------
# averages


def mean_metrics(rows: Sequence[dict], keys: Sequence[str] = ("em", "f1")) -> dict[str, Any]:
    """{"n", <key>: sum / n} over prediction rows (the sample-weighted mean)."""
    n = len(rows)
    return {"n": n, **{k: (sum(float(r[k]) for r in rows) / n if n else 0.0) for k in keys}}


def group_averages(predictions: dict[str, list[dict]], groups: dict[str, str]) -> dict:
    """Per group (and "all"): {"n", "em", "f1"} pooled over its datasets' questions.

    `predictions`: dataset -> prediction rows (with "em", "f1"); `groups`: dataset -> group.
    Pooling the rows (not averaging dataset means) is what makes the average sample-weighted.
    """
    by_group: dict[str, list[dict]] = {}
    for name, rows in predictions.items():
        by_group.setdefault(groups[name], []).extend(rows)
    out = {g: mean_metrics(by_group[g]) for g in sorted(by_group)}
    out[ALL] = mean_metrics([r for rows in predictions.values() for r in rows])
    return out


# --------------------------------------------------------------------------------------------
# policy and rollouts


def load_policy(cfg: TrainConfig, model_dir: str | Path, *, max_batch: int | None = None,
                engine=None):
    """(cfg with the backbone at `model_dir`, tokenizer, engine) for one checkpoint.

    A vLLM `engine` from a previous checkpoint is reused (its weights replaced), since
    starting vLLM costs far more than loading the weights. `max_batch`: rows per forward of
    the hf engine; None = CPU_MAX_BATCH on CPU, the engine's default on GPU.
    """
    backbone = dataclasses.replace(cfg.backbone, path=str(model_dir), revision=None)
    cfg = dataclasses.replace(cfg, backbone=backbone)
    tok = load_tokenizer(backbone)
    if cfg.engine == "vllm":
        if engine is None:
            engine = make_engine(cfg, None, tok)
        else:
            engine.update_weights(load_model(backbone, "cpu").state_dict())
        return cfg, tok, engine
    device = resolve_device(cfg.device)
    engine = make_engine(cfg, load_model(backbone, device), tok)
    if max_batch is not None or device == "cpu":
        engine.max_batch = max_batch or CPU_MAX_BATCH
    return cfg, tok, engine


class _WaveProgress:
    """The engine, passed through, showing each wave's live rows on the progress bar (which
    advances per rollout call only)."""

    def __init__(self, engine, bar):
        self.engine, self.bar, self.wave = engine, bar, 0

    def generate(self, prompts, params, seeds=None):
        self.wave += 1
        self.bar.set_postfix(wave=self.wave, live=len(prompts), refresh=True)
        return self.engine.generate(prompts, params, seeds)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def predict(cfg: TrainConfig, tok, engine, tool, test_sets: Sequence[EvalDataset], *,
            chunk: int = DEFAULT_CHUNK, progress: bool = True) -> dict[str, list[dict]]:
    """Greedy rollouts of every question of every set, scored; dataset -> prediction rows
    (file order). All sets' questions are pooled into rollout calls of `chunk` questions; a
    question that fails is recorded as such (module docstring) and the others go on."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    items = [(s, i, r) for s in test_sets for i, r in enumerate(s.rows)]
    out: dict[str, list] = {s.name: [None] * len(s.rows) for s in test_sets}
    budget = prompt_budget(cfg)
    lengths = prompt_lengths(cfg, tok, [question_of(r) for _, _, r in items])
    todo = []
    for item, n in zip(items, lengths, strict=True):
        if n > budget:
            _record_failure(out, item, "prompt_too_long", too_long(cfg, n))
        else:
            todo.append(item)
    rolled, errors = 0, []
    with progress_bar(total=len(items), desc="evaluate", unit="q", disable=not progress) as bar:
        bar.update(len(items) - len(todo))
        watched = _WaveProgress(engine, bar)
        for start in range(0, len(todo), chunk):
            part = todo[start: start + chunk]
            qs = [question_of(r) for _, _, r in part]
            watched.wave = 0
            results = _rollout_rows(cfg, qs, watched, tool)
            done = [(item, t) for item, t in zip(part, results, strict=True)
                    if isinstance(t, Trajectory)]
            for item, t in zip(part, results, strict=True):
                if not isinstance(t, Trajectory):
                    _record_failure(out, item, "error", t)
                    errors.append((item[2]["id"], t))
            trajs = score(cfg, tok, [t for _, t in done], training=False)
            outcomes = label_outcomes(trajs, tok, {q.id: q for q in qs})
            for ((s, i, r), _), t, outcome in zip(done, trajs, outcomes, strict=True):
                if t.question_id != r["id"]:
                    raise RuntimeError(f"rollout order changed: {t.question_id} for {r['id']}")
                out[s.name][i] = {
                    "id": r["id"], "question": r["question"],
                    "golden_answers": list(r["golden_answers"]), "prediction": t.extra["answer"],
                    "em": float(t.extra["em"]), "f1": float(t.extra["f1"]),
                    "format_ok": bool(t.extra["format_ok"]), "tool_calls": t.num_tool_calls,
                    "queries": [x.query for x in t.turns if x.stop == "search"],
                    "stop": t.turns[-1].stop, "outcome": outcome, "error": None}
            rolled += len(done)
            bar.update(len(part))
    if errors and not rolled:
        first_id, first = errors[0]
        raise RuntimeError(f"every question's rollout raised ({len(errors)}; the first, "
                           f"{first_id!r}: {first}): a failure of the run, not of one row")
    return out  # every slot is filled: a prediction or a recorded failure


def _rollout_rows(cfg: TrainConfig, qs: list[Question], engine, tool
                  ) -> list[Trajectory | str]:
    """Greedy rollouts of `qs`, one per question. Where the call raises anything but `_FATAL`,
    it is split in halves until each question that raises stands alone; such a question gets
    "<exception type>: <message>" in place of a trajectory. (The halves run in smaller engine
    batches; greedy decoding gives the same tokens up to ties within batch-padding noise.)"""
    try:
        return list(rollout(cfg, qs, engine, tool, seed=GREEDY_SEED, greedy=True))
    except _FATAL:
        raise
    except Exception as e:  # one question's failure must not end the others
        error = f"{type(e).__name__}: {e}"
    # outside the handler, so the failed call's traceback (and its tensors) is freed first
    if len(qs) == 1:
        return [error]
    log.warning("a rollout call of %d questions raised (%s); splitting it to find the "
                "questions that fail", len(qs), error)
    mid = len(qs) // 2
    return (_rollout_rows(cfg, qs[:mid], engine, tool)
            + _rollout_rows(cfg, qs[mid:], engine, tool))


def _record_failure(out: dict[str, list], item: tuple[EvalDataset, int, dict], outcome: str,
                    error: str) -> None:
    s, i, r = item
    log.warning("%s: row %d (id %r) not evaluated (%s): %s; recorded with an empty prediction",
                s.path, i, r["id"], outcome, error)
    out[s.name][i] = {
        "id": r["id"], "question": r["question"], "golden_answers": list(r["golden_answers"]),
        "prediction": None, "em": 0.0, "f1": 0.0, "format_ok": False, "tool_calls": 0,
        "queries": [], "stop": None, "outcome": outcome, "error": error}


# --------------------------------------------------------------------------------------------
# one checkpoint


def write_results(out_dir: str | Path, test_sets: Sequence[EvalDataset],
                  predictions: dict[str, list[dict]], *, step: int, checkpoint: str,
                  criterion: str | None, label: str) -> dict:
    """Write the files of the module docstring into `out_dir` (replaced atomically as a
    whole); returns the summary."""
    groups = {s.name: s.group for s in test_sets}
    datasets, per_set = {}, {}
    for s in test_sets:
        rows = predictions[s.name]
        if len(rows) != len(s.rows):
            raise ValueError(f"{s.path}: {len(rows)} predictions for {len(s.rows)} questions")
        m = mean_metrics(rows, ("em", "f1", "format_ok", "tool_calls"))
        failed = sum(r.get("outcome") in ROW_FAILURES for r in rows)
        per_set[s.name] = {"dataset": s.name, "group": s.group, **m, "step": step,
                           "checkpoint": checkpoint, "criterion": criterion, "failed": failed}
        if rows and all("outcome" in r for r in rows):
            counts = Counter(r["outcome"] for r in rows)
            per_set[s.name]["outcomes"] = {o: counts[o] / len(rows)
                                           for o in (*OUTCOMES, *ROW_FAILURES)}
        datasets[s.name] = {"n": m["n"], "em": m["em"], "f1": m["f1"], "group": s.group,
                            "failed": failed}
    summary = {"step": step, "checkpoint": checkpoint, "criterion": criterion, "label": label,
               "failed": sum(d["failed"] for d in datasets.values()),
               "datasets": datasets, "groups": group_averages(predictions, groups)}
    with atomic_path(out_dir, directory=True) as tmp:
        for name, record in per_set.items():
            atomic_write_jsonl(tmp / f"{name}.predictions.jsonl", predictions[name])
            atomic_write_json(tmp / f"{name}.json", record)
        atomic_write_json(tmp / SUMMARY_FILE, summary)
        # the evaluation's tracker (open since before the evaluation) logs into
        # <out_dir>/tracking: moved, not copied, so its open files go with the new folder
        tracking = Path(out_dir) / TRACKING_SUBDIR
        if tracking.is_dir():
            tracking.rename(tmp / TRACKING_SUBDIR)
    return summary


def evaluate_checkpoint(cfg: TrainConfig, model_dir: str | Path, test_sets: Sequence[EvalDataset],
                        out_dir: str | Path, *, step: int, checkpoint: str,
                        criterion: str | None, label: str, retriever,
                        chunk: int = DEFAULT_CHUNK, max_batch: int | None = None,
                        engine=None, progress: bool = True) -> tuple[dict, Any, dict]:
    """Roll out, score and write one checkpoint's results.

    Returns (summary, engine, timing); the engine can be handed to the next call (vLLM reuse).
    """
    from a2tgpo.train.checkpoint import COMPLETE, verify_checkpoint

    t0 = time.perf_counter()
    if (Path(model_dir).parent / COMPLETE).is_file():  # a training checkpoint: sizes, sha256
        verify_checkpoint(Path(model_dir).parent)
    ccfg, tok, engine = load_policy(cfg, model_dir, max_batch=max_batch, engine=engine)
    tool = search_tool(cfg, retriever, tok)
    t1 = time.perf_counter()
    predictions = predict(ccfg, tok, engine, tool, test_sets, chunk=chunk, progress=progress)
    t2 = time.perf_counter()
    summary = write_results(out_dir, test_sets, predictions, step=step, checkpoint=checkpoint,
                            criterion=criterion, label=label)
    n = sum(len(v) for v in predictions.values())
    timing = {"questions": n, "load_seconds": t1 - t0, "rollout_seconds": t2 - t1,
              "questions_per_s": n / max(1e-9, t2 - t1),
              "retrieval_calls": tool.calls,
              "obs_cut": tool.cut / tool.observations if tool.observations else 0.0}
    for name, d in summary["datasets"].items():
        log.info("step %d %s (%s): EM %.4f F1 %.4f on %d questions", step, name, d["group"],
                 d["em"], d["f1"], d["n"])
    return summary, engine, timing


def tracked_metrics(summary: dict, prefix: str = "test") -> dict[str, float]:
    """`<prefix>/<dataset>/{em,f1}` and `<prefix>/<group>/{em,f1}` of a summary."""
    out = {}
    for name, d in [*summary["datasets"].items(), *summary["groups"].items()]:
        out[f"{prefix}/{name}/em"] = d["em"]
        out[f"{prefix}/{name}/f1"] = d["f1"]
    return out


class _Track:
    """A Tracker attached to the cell's run, open from before the evaluation to its end: the
    run is RUNNING meanwhile and its system metrics cover the evaluation. Calling it with `fn`
    logs the results (`fn(tracker)`) and the job's peak memory (peak_memory/<job>/...), then
    ends the Tracker; `end(exc)` ends it on the evaluation's exception instead (the run ends
    FAILED, or KILLED on a stop). Never raises: the results are written, and tracking is the
    browsing layer only."""

    def __init__(self, cell: Path, cfg: TrainConfig, out_dir: Path, tags: dict, job: str):
        self.cell, self.out_dir, self.job = cell, out_dir, job
        self._stack = contextlib.ExitStack()
        self.tracker: Tracker | None = None
        try:
            self.tracker = self._stack.enter_context(Tracker.attach(
                cell, cfg.tracking, results_dir=cfg.results_dir,
                out_dir=out_dir / TRACKING_SUBDIR, tags=tags))
        except Exception as e:
            self._failed(e)

    def __call__(self, fn) -> None:
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return
        try:
            with self._stack:
                fn(tracker)
                tracker.summary(job_peak(f"peak_memory/{self.job}"))
        except Exception as e:
            self._failed(e)

    def end(self, exc: BaseException) -> None:
        tracker, self.tracker = self.tracker, None
        if tracker is not None:
            try:
                self._stack.__exit__(type(exc), exc, exc.__traceback__)
            except Exception as e:
                self._failed(e)

    def _failed(self, e: Exception) -> None:
        log.warning("tracking the evaluation of %s failed (%s: %s); results in %s are complete",
                    self.cell, type(e).__name__, e, self.out_dir)


def eval_inputs(test_sets: Sequence[EvalDataset]) -> list[dict]:
    """The test sets as MLflow dataset inputs (a2tgpo.data.qa.dataset_input)."""
    return [dataset_input(s.path, "test") for s in test_sets]


def evidence_files(out_dir: Path, test_sets: Sequence[EvalDataset],
                   best_path: str | Path) -> list[Path]:
    """What an evaluation of the selected checkpoint leaves for a person to read, in the order
    the run gets them: per test set its predictions and record, the summary, best.json."""
    files = [out_dir / f"{s.name}{ext}" for s in test_sets
             for ext in (".predictions.jsonl", ".json")]
    return [*files, out_dir / SUMMARY_FILE, Path(best_path)]


def _one_line(summary: dict, timing: dict, out_dir: Path) -> str:
    groups = ", ".join(f"{g} {d['em']:.4f}" for g, d in summary["groups"].items())
    failed = (f" ({summary['failed']} not evaluated: outcome and error in the predictions)"
              if summary["failed"] else "")
    return (f"step {summary['step']} ({summary['label']}): EM {groups} on "
            f"{len(summary['datasets'])} test sets, {timing['questions']} questions{failed} in "
            f"{timing['rollout_seconds']:.1f} s ({timing['questions_per_s']:.1f} q/s) -> "
            f"{out_dir}")


# --------------------------------------------------------------------------------------------
# entry points


@contextlib.contextmanager
def _evaluating(track: _Track, cfg: TrainConfig) -> Iterator[Any]:
    """The study's retriever for an evaluation, closed after it; an exception (a failure, a
    stop) ends the evaluation's tracked run with it before it propagates."""
    retriever = build_retriever(cfg.retrieval, cfg.corpus, cfg.index)
    try:
        yield retriever
    except BaseException as e:
        track.end(e)
        raise
    finally:
        retriever.close()


def evaluate_best(cfg: TrainConfig, best_path: str | Path, test_paths: Sequence[str | Path],
                  out_dir: str | Path, *, chunk: int = DEFAULT_CHUNK,
                  max_batch: int | None = None, progress: bool = True) -> tuple[dict, str]:
    """Evaluate the checkpoint best.json selected; returns (summary, one-line report).

    The cell directory is `cfg.run_dir`; best.json's checkpoint is relative to it.
    """
    cell, out = Path(cfg.run_dir), Path(out_dir)
    best = read_best(best_path, cell)
    test_sets = load_test_sets(test_paths)  # fail on bad inputs before loading models
    tags = {"eval.criterion": best["criterion"], "eval.label": best["label"],
            "eval.step": best["step"], "eval.checkpoint": best["checkpoint"]}
    track = _Track(cell, cfg, out, tags, "eval")
    with _evaluating(track, cfg) as retriever:
        summary, _, timing = evaluate_checkpoint(
            cfg, best["model_dir"], test_sets, out, step=int(best["step"]),
            checkpoint=best["checkpoint"], criterion=best["criterion"], label=best["label"],
            retriever=retriever, chunk=chunk, max_batch=max_batch, progress=progress)

    def log_all(tracker):
        tracker.log(tracked_metrics(summary), summary["step"])
        tracker.summary({"eval/step": summary["step"], "eval/questions": timing["questions"],
                         "eval/seconds": timing["rollout_seconds"],
                         "eval/questions_per_s": timing["questions_per_s"]})
        tracker.log_inputs(eval_inputs(test_sets))
        for path in evidence_files(out, test_sets, best_path):
            tracker.log_artifact(path, EVIDENCE_DIR)

    track(log_all)
    return summary, _one_line(summary, timing, out)


def evaluate_all(cfg: TrainConfig, test_paths: Sequence[str | Path], out_dir: str | Path, *,
                 chunk: int = DEFAULT_CHUNK, max_batch: int | None = None,
                 progress: bool = True) -> tuple[dict[int, dict], str]:
    """Evaluate every complete checkpoint of the cell into `<out>/step_NNNNNN/`.

    A step whose summary.json already holds the same checkpoint and test sets is kept (a
    rerun after a kill continues where it stopped). Returns ({step: summary}, a report line).
    """
    cell, out = Path(cfg.run_dir), Path(out_dir)
    ckpts = complete_checkpoints(cell)
    if not ckpts:
        raise FileNotFoundError(f"{cell / 'checkpoints'}: no complete checkpoint to evaluate")
    test_sets = load_test_sets(test_paths)
    names = sorted(s.name for s in test_sets)
    summaries: dict[int, dict] = {}
    todo = []
    for step, model_dir in ckpts.items():
        rel = str(model_dir.relative_to(cell))
        done = out / step_dir_name(step) / SUMMARY_FILE
        if done.is_file():
            old = json.loads(done.read_text())
            if old.get("checkpoint") == rel and sorted(old.get("datasets", {})) == names:
                log.info("step %d: already evaluated (%s); kept", step, done)
                summaries[step] = old
                continue
        todo.append((step, model_dir, rel))
    timings = {}
    engine = None
    if todo:
        track = _Track(cell, cfg, out, {}, "eval_all")
        with _evaluating(track, cfg) as retriever:
            for step, model_dir, rel in todo:
                summaries[step], engine, timings[step] = evaluate_checkpoint(
                    cfg, model_dir, test_sets, out / step_dir_name(step), step=step,
                    checkpoint=rel, criterion=None, label=f"step {step}", retriever=retriever,
                    chunk=chunk, max_batch=max_batch, engine=engine, progress=progress)

        def log_all(tracker):
            for step in sorted(timings):
                tracker.log(tracked_metrics(summaries[step], "test_by_checkpoint"), step)
            tracker.log_inputs(eval_inputs(test_sets))

        track(log_all)
    summaries = dict(sorted(summaries.items()))
    n = sum(t["questions"] for t in timings.values())
    secs = sum(t["rollout_seconds"] for t in timings.values())
    curve = ", ".join(f"{s}: {v['groups'][ALL]['em']:.4f}" for s, v in summaries.items())
    line = (f"{len(summaries)} checkpoints ({len(timings)} evaluated now, {n} questions in "
            f"{secs:.1f} s); EM over all test questions by step: {curve} -> {out}")
    return summaries, line


def main(config_path: str, overrides: Sequence[str], *, test: Sequence[str], out_dir: str,
         best: str | None = None, all_checkpoints: bool = False, section: str | None = None,
         chunk: int = DEFAULT_CHUNK, max_batch: int | None = None) -> int:
    """CLI entry (`a2tgpo evaluate`): exactly one of `best` / `all_checkpoints`."""
    if (best is None) == (not all_checkpoints):
        raise ValueError("give exactly one of --best and --all-checkpoints")
    cfg = load_config(TrainConfig, config_path, overrides, section=section)
    if all_checkpoints:
        _, line = evaluate_all(cfg, test, out_dir, chunk=chunk, max_batch=max_batch)
    else:
        _, line = evaluate_best(cfg, best, test, out_dir, chunk=chunk, max_batch=max_batch)
    print(line)
    return 0
