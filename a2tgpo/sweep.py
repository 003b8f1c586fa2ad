"""Optuna sweeps of A2TGPO's β (adaptive-clip strength) and γ (turn discount) as DAG jobs.

A sweep config (config/sweeps/<name>.yaml, listed in the study config's `sweeps`) names a base
grid cell (backbone, method, seed), a search space for `method.advantage.beta` and
`method.advantage.gamma` (either may be fixed), a sampler, the number of trials and extra dotted
TrainConfig overrides for the trials (e.g. fewer steps). Fixed β grids stay Snakemake grid points
(grid.sets); a sweep is for open searches (DESIGN §3 "Sweeps").

Layout under `<results>/<study>/sweeps/<name>/`:

    base.yaml                 the base cell's resolved TrainConfig (rule sweep_base_config)
    journal.log               the Optuna study (JournalStorage + JournalFileBackend)
    trials/<i>/run/           trial i's training run (config.yaml, metrics.jsonl, checkpoints/)
    trials/<i>/result.json    trial i's outcome (rule sweep_trial): number, params, value, state
    summary.json, best.png    the best trial, every trial, and the plots (rule sweep_summary)

Trial jobs (`a2tgpo sweep-trial`, one Snakemake job per index i, in parallel) do ask → resolve
the trial's TrainConfig → train in-process → objective from the run's metrics.jsonl → tell →
write result.json atomically. The journal file takes parallel writers on one filesystem (NFS
included: a symlink lock), and each job's ask phase (stale-trial handling, enqueue, ask) runs
under a second symlink lock, so concurrent jobs never take each other's queued trials.

Restarts. JournalStorage has no heartbeat, so a job killed mid-training leaves its Optuna trial
RUNNING. Every Optuna trial carries the user attr `index`; when job i starts again, the RUNNING
trials of index i are marked FAIL (logged) and the latest one's params are enqueued, so the new
trial of index i gets the same β/γ and `train` resumes from the run folder's checkpoints. A
trial whose training raised is failed at once and retried with the same params the same way. A
run folder whose config differs from the trial's (other params, a changed base config) is moved
aside to `run.aside-<n>` (never deleted) and the trial starts fresh. An index whose latest trial
is COMPLETE with a matching run folder is not trained again: its result is written from the run.

Each trial is an MLflow run of its own (run name `sweep~<name>/trial~<i>`, tags sweep, trial,
optuna_trial, beta, gamma) in the study's experiment, through the normal training Tracker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from a2tgpo.config import (
    SEED_LIMIT,
    ConfigError,
    InvalidKey,
    from_dict,
    load_config,
    name_error,
    option,
    parse_override,
    to_dict,
)
from a2tgpo.ops.lock import folder_lock

log = logging.getLogger(__name__)

PARAMS = ("beta", "gamma")  # searchable keys, both under method.advantage
RESERVED_NAMES = {"trial", "summary", "base_config"}  # would clash with rule names sweep_<x>
RESULT_FILE = "result.json"
# keys a sweep's overrides may not set: the trial sets them
_OWN_KEYS = ("run_dir", "cell", "results_dir", "method.advantage.beta",
             "method.advantage.gamma")


class SweepError(RuntimeError):
    """A sweep cannot go on (Optuna storage failure, objective missing); the message says why."""


# --------------------------------------------------------------------------------------------
# the sweep config


@dataclass(frozen=True)
class ParamRange:
    """One searched value: a range (low, high, optional step), a fixed value, or neither (the
    base method's own value)."""

    low: float | None = option(None, "Lower bound (inclusive).")
    high: float | None = option(None, "Upper bound (inclusive).")
    step: float | None = option(None, "Discretisation step (null = continuous); required by "
                                      "sampler grid.", gt=0)
    fixed: float | None = option(None, "Fix the value instead of searching it (low/high unset).")

    def __post_init__(self) -> None:
        if self.fixed is not None:
            if self.low is not None or self.high is not None or self.step is not None:
                raise ValueError("give either fixed or low/high[/step], not both")
            return
        if (self.low is None) != (self.high is None):
            raise ValueError("give both low and high (or fixed)")
        if self.low is None:
            if self.step is not None:
                raise ValueError("step without low/high")
            return
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be < high ({self.high}); "
                             "use fixed for a single value")
        if self.step is not None:
            if self.step <= 0:
                raise ValueError(f"step must be > 0, got {self.step}")
            n = (self.high - self.low) / self.step
            if abs(n - round(n)) > 1e-6:
                raise ValueError(f"high - low ({self.high} - {self.low}) is not a multiple of "
                                 f"step {self.step}")

    @property
    def searched(self) -> bool:
        return self.low is not None

    def grid(self) -> list[float]:
        """The grid points low, low + step, ..., high (rounded to 10 significant digits)."""
        n = round((self.high - self.low) / self.step)
        return [float(f"{self.low + k * self.step:.10g}") for k in range(n + 1)]


@dataclass(frozen=True)
class SearchSpace:
    """What the sweep searches: β and γ of the base method's advantage estimator."""

    beta: ParamRange = option(
        doc="method.advantage.beta, A2TGPO's adaptive-clip strength (>= 0); e.g. "
        "{low: 0.0, high: 0.5}. Empty = the base method's value.", factory=ParamRange)
    gamma: ParamRange = option(
        doc="method.advantage.gamma, the discount over turns (in [0, 1]); e.g. "
        "{low: 0.8, high: 1.0}. Empty = the base method's value.", factory=ParamRange)

    def __post_init__(self) -> None:
        if not (self.beta.searched or self.gamma.searched):
            raise ValueError("search at least one of beta, gamma (low/high)")
        for name, lo, hi in (("beta", 0.0, math.inf), ("gamma", 0.0, 1.0)):
            r: ParamRange = getattr(self, name)
            for v in (r.low, r.high, r.fixed):
                if v is not None and not lo <= v <= hi:
                    raise ValueError(f"{name}: {v} is outside [{lo}, {hi}]")

    @property
    def searched(self) -> tuple[str, ...]:
        return tuple(p for p in PARAMS if getattr(self, p).searched)


@dataclass(frozen=True)
class SamplerConfig:
    """The Optuna sampler every trial job builds."""

    kind: Literal["tpe", "grid"] = option(
        "tpe", "tpe = TPESampler (Optuna 5: multivariate, constant liar for parallel jobs); "
        "grid = GridSampler over low..high by step (every searched value needs a step).")
    seed: int = option(0, "Sampler seed. tpe: trial job i seeds its sampler with (seed, i), "
                          "so random start-up points do not repeat across parallel jobs; "
                          "grid: the order the grid is visited in.", ge=0, lt=SEED_LIMIT)
    n_startup_trials: int = option(10, "tpe: random trials before TPE starts modelling.", ge=0)

    def __post_init__(self) -> None:
        if self.n_startup_trials < 0:
            raise ValueError("n_startup_trials must be >= 0")


@dataclass(frozen=True)
class SweepBase:
    """The grid cell whose resolved config every trial starts from (then its β/γ and the
    sweep's overrides)."""

    backbone: str = option(doc="Backbone id (one of the study's backbones).")
    method: str = option("a2tgpo", "Method id (config/methods/<id>.yaml); it must read the "
                                   "searched keys (β: loss.adaptive_clip true; γ: estimator "
                                   "igpo_family or gigpo).")
    seed: int = option(1, "Training seed of every trial.", ge=0, lt=SEED_LIMIT)
    track: str = option("", "Training track (a key of the study's `tracks`); empty = the "
                            "study's single implicit track (a study without tracks).")


@dataclass(frozen=True)
class SweepConfig:
    """One Optuna sweep (config/sweeps/<name>.yaml): `snakemake sweep_<name>` runs it."""

    name: str = option(doc="Sweep name: the Optuna study name, the folder "
                           "<results>/<study>/sweeps/<name>/ and the target sweep_<name>.")
    base: SweepBase = option(doc="The base grid cell.")
    n_trials: int = option(doc="Trials (Snakemake jobs trials/0 .. n-1; as many run at once as "
                               "Snakemake's cores/resources allow). Raising it later adds trials.",
                           ge=1)
    search: SearchSpace = option(doc="The search space.")
    sampler: SamplerConfig = option(doc="The Optuna sampler.", factory=SamplerConfig)
    direction: Literal["maximize", "minimize"] = option("maximize", "Optimisation direction.")
    metric: str = option(
        "val/em", "metrics.jsonl key whose best value over the trial's run (max when "
        "maximizing) is the objective: one of the validation metrics (val/em, val/f1, "
        "val/format_ok, val/tool_calls, val/outcome/..., val/seconds; checked when the file "
        "loads). val/em = greedy dev EM, so the default objective is the run's best dev EM "
        "(summary.json best_val_em).")
    overrides: tuple[str, ...] = option(
        (), "Dotted TrainConfig overrides for every trial, after the base cell's config, e.g. "
        "[schedule.steps=4]; run_dir, cell, results_dir, beta and gamma are the sweep's.")

    def __post_init__(self) -> None:
        if error := name_error(self.name):
            raise InvalidKey("name", error)
        if self.name in RESERVED_NAMES:
            raise ValueError(f"name {self.name!r} is reserved (rule sweep_{self.name} exists)")
        if self.n_trials < 1:
            raise ValueError(f"n_trials must be >= 1, got {self.n_trials}")
        for text in self.overrides:
            keys, _ = parse_override(text)
            key = ".".join(keys)
            if key in _OWN_KEYS:
                raise ValueError(f"overrides: {key} is set by the sweep (search / per trial)")
        if self.sampler.kind == "grid":
            for p in self.search.searched:
                if getattr(self.search, p).step is None:
                    raise ValueError(f"sampler grid: search.{p} needs a step")
            size = math.prod(len(getattr(self.search, p).grid()) for p in self.search.searched)
            if self.n_trials > size:
                raise ValueError(f"sampler grid has {size} points but n_trials is "
                                 f"{self.n_trials}")

    def fingerprint(self) -> dict:
        """What must not change once the study exists (n_trials may grow)."""
        d = to_dict(self)
        d.pop("n_trials")
        return d


def load_sweep(path: str | Path, overrides=()) -> SweepConfig:
    """Strict loading of a sweep config file (ConfigError names the file and the key)."""
    sweep = load_config(SweepConfig, path, overrides)
    if error := metric_error(sweep.metric):
        raise ConfigError(f"{path}: metric: {error}")
    return sweep


def metric_error(metric: str) -> str | None:
    """Why `metric` cannot be a trial's objective (None: it can): the objective is read from
    the validation rows of metrics.jsonl, so it must be a key validate() writes
    (a2tgpo.train.rl.validation_metrics); any other name fails only after a whole trial."""
    import difflib
    import fnmatch

    from a2tgpo.train.rl import validation_metrics

    known = validation_metrics()
    if any(fnmatch.fnmatchcase(metric, key) for key in known):
        return None
    near = difflib.get_close_matches(metric, [k for k in known if "*" not in k], n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return (f"{metric!r} is not a metric validation writes to metrics.jsonl{hint}; one of "
            f"{', '.join(known)} (* = a hop type of the data)")


def check_method(sweep: SweepConfig, method, source: str) -> None:
    """The base method must read every searched (or fixed) key, else its trials would train
    the same run: β needs loss.adaptive_clip, γ an igpo_family or gigpo estimator."""
    reads = {"beta": (method.reads_beta, "loss.adaptive_clip: true"),
             "gamma": (method.reads_gamma, "advantage.estimator igpo_family or gigpo")}
    for p in sweep.search.searched + tuple(p for p in PARAMS
                                           if getattr(sweep.search, p).fixed is not None):
        ok, needs = reads[p]
        if not ok:
            raise ConfigError(
                f"{source}: search.{p}: method {method.id!r} (advantage estimator "
                f"{method.advantage.estimator!r}, loss.adaptive_clip "
                f"{str(method.loss.adaptive_clip).lower()}) does not read {p}; it needs {needs}")


def sweep_dir(base, sweep: SweepConfig) -> Path:
    """<results>/<study>/sweeps/<name> (base: the base TrainConfig; results_dir is the study's)."""
    return Path(base.results_dir) / "sweeps" / sweep.name


def trial_config(base, sweep: SweepConfig, index: int, params: dict[str, float]):
    """Trial `index`'s TrainConfig: the base cell's config, the sweep's overrides, then the
    trial's run folder, cell name and β/γ; validated strictly."""
    from a2tgpo.config import apply_overrides
    from a2tgpo.train.config import TrainConfig

    data = to_dict(base)
    source = f"sweep {sweep.name} trial {index}"
    try:
        data = apply_overrides(data, sweep.overrides)
    except ConfigError as e:
        raise ConfigError(f"{source}: overrides: {e}") from None
    data["run_dir"] = str(sweep_dir(base, sweep) / "trials" / str(index) / "run")
    data["cell"] = f"sweep~{sweep.name}/trial~{index}"
    adv = data["method"]["advantage"]
    for p in PARAMS:
        r: ParamRange = getattr(sweep.search, p)
        if p in params:
            adv[p] = params[p]
        elif r.fixed is not None:
            adv[p] = r.fixed
    cfg = from_dict(TrainConfig, data, source=f"{source} (base config + sweep overrides)")
    if cfg.backend != "single":
        raise ConfigError(f"{source}: trials train in-process (backend single); the base "
                          f"config says backend {cfg.backend!r}: add backend=single to the "
                          "sweep's overrides")
    return cfg


def trial_values(cfg) -> dict[str, float]:
    """β and γ a trial's config actually trains with."""
    return {p: getattr(cfg.method.advantage, p) for p in PARAMS}


# --------------------------------------------------------------------------------------------
# Optuna storage, samplers, the ask phase


def journal_path(directory: str | Path) -> Path:
    return Path(directory) / "journal.log"


def open_storage(directory: str | Path):
    """JournalStorage on <directory>/journal.log (symlink lock: parallel processes, NFS too).

    A job killed while appending leaves an unfinished last line; Optuna skips it when reading
    but appends the next operation to it, and the line glued together then fails every later
    read ("Invalid log format"): the sweep could never be opened again. So the journal's own
    lock, whenever it is taken (every append), first cuts such a line, keeping its bytes in
    journal.log.partial (`a2tgpo.io.cut_unfinished_line`); and before Optuna reads the
    journal, it is checked under that lock: a damaged line in the middle is a SweepError
    naming the file and line.
    """
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from a2tgpo.io import JsonLinesError, iter_jsonl

    path = journal_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = _journal_lock(path)
    if path.exists():
        lock.acquire()  # the cut (in acquire), then the check, with no writer at work
        try:
            for _ in iter_jsonl(path):
                pass
        except JsonLinesError as e:
            raise SweepError(f"{e}: the sweep's Optuna journal is damaged there (not a line a "
                             "killed writer left unfinished), and Optuna cannot read the study "
                             "past it; repair or remove that line, or move the sweep's folder "
                             "aside") from None
        finally:
            lock.release()
    return JournalStorage(JournalFileBackend(str(path), lock))


def _journal_lock(path: Path):
    """Optuna's symlink lock on the journal (the same lock file), which also cuts an
    unfinished last line each time it is taken, before its holder appends."""
    from optuna.storages.journal import JournalFileSymlinkLock

    from a2tgpo.io import cut_unfinished_line

    class CuttingLock(JournalFileSymlinkLock):
        def acquire(self) -> bool:
            super().acquire()
            try:
                cut_unfinished_line(path)
            except BaseException:
                self.release()
                raise
            return True

    return CuttingLock(str(path))


@contextlib.contextmanager
def ask_lock(directory: str | Path) -> Iterator[None]:
    """Serialises the ask phase of parallel trial jobs (<journal>.ask.lock; a holder that died
    is overridden after 30 s, like the journal's own lock)."""
    from optuna.storages.journal import JournalFileSymlinkLock

    Path(directory).mkdir(parents=True, exist_ok=True)
    lock = JournalFileSymlinkLock(str(journal_path(directory)) + ".ask")
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def make_sampler(sweep: SweepConfig, index: int):
    import numpy as np
    import optuna

    if sweep.sampler.kind == "grid":
        # the grid's shuffled order comes from the seed: every process must use the same one
        space = {p: getattr(sweep.search, p).grid() for p in sweep.search.searched}
        return optuna.samplers.GridSampler(space, seed=sweep.sampler.seed)
    seed = int(np.random.SeedSequence([sweep.sampler.seed, index]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=sweep.sampler.n_startup_trials)


def distributions(sweep: SweepConfig) -> dict:
    from optuna.distributions import FloatDistribution

    out = {}
    for p in sweep.search.searched:
        r: ParamRange = getattr(sweep.search, p)
        out[p] = FloatDistribution(r.low, r.high, step=r.step)
    return out


def _optuna(sweep: SweepConfig, directory, what: str, fn: Callable[[], Any]) -> Any:
    """Run an Optuna call; any failure becomes a SweepError that says what and where."""
    try:
        return fn()
    except (ConfigError, SweepError):
        raise
    except Exception as e:
        raise SweepError(f"sweep {sweep.name}: Optuna {what} failed ({journal_path(directory)}): "
                         f"{type(e).__name__}: {e}") from e


def load_study(sweep: SweepConfig, directory: str | Path, *, sampler=None, base_hash: str = ""):
    """Create or load the sweep's Optuna study; refuse one made for a different sweep config."""
    import optuna

    def create():
        return optuna.create_study(storage=open_storage(directory), study_name=sweep.name,
                                   direction=sweep.direction, sampler=sampler,
                                   load_if_exists=True)

    study = _optuna(sweep, directory, "opening the study", create)
    attrs = study.user_attrs
    want = sweep.fingerprint()
    if "sweep_config" not in attrs:
        _optuna(sweep, directory, "recording the sweep config", lambda: (
            study.set_user_attr("sweep_config", want),
            study.set_user_attr("base_hash", base_hash)))
    else:
        from a2tgpo.tracking import flatten

        have, now = flatten(attrs["sweep_config"], "."), flatten(want, ".")
        changed = sorted(k for k in set(have) | set(now)
                         if json.dumps(have.get(k)) != json.dumps(now.get(k)))
        if changed == ["metric"] and _never_valid_metric(study, have["metric"]):
            # no trial could finish with it (no run writes it), so none has a value to keep;
            # the failed trials are retried with their params and their run folders, which
            # do not depend on the metric, are resumed
            log.warning("sweep %s: %s was made with metric %r, which no run writes and no "
                        "trial finished with; it now records metric %r", sweep.name,
                        journal_path(directory), have["metric"], sweep.metric)
            _optuna(sweep, directory, "recording the corrected metric",
                    lambda: study.set_user_attr("sweep_config", want))
            changed = []
        if changed:
            raise ConfigError(
                f"sweep {sweep.name}: {journal_path(directory)} holds a study made with a "
                f"different sweep config (changed: {', '.join(changed)}); only n_trials may "
                "change. Use a new sweep name, or move the sweep's folder aside")
        if base_hash and attrs.get("base_hash") not in (None, "", base_hash):
            log.warning("sweep %s: the base cell's resolved config changed since the study "
                        "started; trials before and after are not comparable", sweep.name)
    return study


def _never_valid_metric(study, metric: str) -> bool:
    """Whether the study's recorded `metric` is not one validation writes and no trial of the
    study finished (COMPLETE) with it."""
    from optuna.trial import TrialState

    return metric_error(metric) is not None and not study.get_trials(
        deepcopy=False, states=(TrialState.COMPLETE,))


def teller(study):
    """A handle on the same study for `tell`: GridSampler.after_trial calls study.stop(),
    which raises outside study.optimize, so tells go through a plain sampler."""
    import optuna

    return optuna.load_study(study_name=study.study_name, storage=study._storage,
                             sampler=optuna.samplers.RandomSampler())


def config_hash(cfg) -> str:
    d = to_dict(cfg)
    for key in ("run_dir", "cell"):
        d.pop(key, None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Claim:
    """What the ask phase gave trial job `index`."""

    number: int  # the Optuna trial number
    params: dict[str, float]  # searched values
    retry_of: int | None = None  # the failed/stale trial whose params this one repeats
    reuse: bool = False  # a COMPLETE trial whose run folder matches: no training
    trial: Any = None  # the optuna.Trial (None when reused)


def _index_trials(study, index: int) -> list:
    return sorted((t for t in study.get_trials(deepcopy=False)
                   if t.user_attrs.get("index") == index), key=lambda t: t.number)


def claim_trial(study, sweep: SweepConfig, index: int, *,
                matches_run: Callable[[dict[str, float]], bool] = lambda params: False,
                directory: str | Path = "") -> Claim:
    """The ask phase of trial job `index` (call it under `ask_lock`).

    - latest trial of this index COMPLETE and `matches_run(params)`: reuse it;
    - RUNNING trials of this index (their job was killed): mark them FAIL, then enqueue the
      latest one's params (the new trial resumes its checkpoints);
    - latest trial FAIL (training raised): enqueue its params again;
    - otherwise (or after enqueueing) ask a new trial and suggest the searched values.
    """
    from optuna.trial import TrialState

    mine = _index_trials(study, index)
    latest = mine[-1] if mine else None
    if latest is not None and latest.state == TrialState.COMPLETE and \
            matches_run(dict(latest.params)):
        log.info("sweep %s trial %d: Optuna trial #%d is COMPLETE and its run folder matches; "
                 "reusing it", sweep.name, index, latest.number)
        return Claim(latest.number, dict(latest.params), reuse=True)
    retry = None
    stale = [t for t in mine if t.state == TrialState.RUNNING]
    for t in stale:
        log.warning("sweep %s trial %d: Optuna trial #%d (params %s) is still RUNNING from a "
                    "job that was killed (journal storage has no heartbeat): marking it FAIL",
                    sweep.name, index, t.number, _fmt(t.params))
        _optuna(sweep, directory, f"failing stale trial #{t.number}",
                lambda t=t: teller(study).tell(t.number, state=TrialState.FAIL,
                                               skip_if_finished=True))
    if stale:
        retry = stale[-1]
    elif latest is not None and latest.state == TrialState.FAIL:
        retry = latest
    waiting = [t for t in mine if t.state == TrialState.WAITING]
    if retry is not None and retry.params and not waiting:
        log.warning("sweep %s trial %d: re-enqueueing the params of trial #%d (%s) so the new "
                    "trial resumes its run", sweep.name, index, retry.number, _fmt(retry.params))
        _optuna(sweep, directory, "enqueueing the retry", lambda: study.enqueue_trial(
            dict(retry.params), user_attrs={"index": index, "sweep": sweep.name,
                                            "retry_of": retry.number}))
    trial = _optuna(sweep, directory, "ask", study.ask)
    attrs = trial.user_attrs
    if attrs.get("index", index) != index:
        log.warning("sweep %s trial %d: took queued trial #%d meant for index %s",
                    sweep.name, index, trial.number, attrs.get("index"))
    _optuna(sweep, directory, "setting trial attributes", lambda: (
        trial.set_user_attr("index", index), trial.set_user_attr("sweep", sweep.name)))
    dists = distributions(sweep)
    params = _optuna(sweep, directory, "sampling", lambda: {
        p: trial.suggest_float(p, d.low, d.high, step=d.step) for p, d in dists.items()})
    return Claim(trial.number, params, retry_of=attrs.get("retry_of"), trial=trial)


def _fmt(params: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in sorted(params.items())) or "-"


# --------------------------------------------------------------------------------------------
# one trial


def objective(run_dir: str | Path, metric: str, direction: str, *, trains: bool) -> float:
    """Best value of `metric` over the run's steps in metrics.jsonl (a resumed step's later row
    wins), by checkpoint selection's rule (a2tgpo.train.best.best_step): step 0, the starting
    policy, counts only for a method that does not train (every trial starts from it, so it
    would tie trials that training has not yet moved); `trains` = the trial's method.train."""
    from a2tgpo.tracking import read_metrics
    from a2tgpo.train.best import best_step

    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        raise SweepError(f"{run_dir}: no metrics.jsonl; the trial's training wrote nothing") \
            from None
    by_step = {}
    for r in rows:
        if r.get(metric) is not None:
            by_step[int(r["step"])] = float(r[metric])
    if not by_step:
        raise SweepError(f"{run_dir}/metrics.jsonl has no value of {metric!r} (the sweep's "
                         "metric); check the key (e.g. val/em)")
    step = best_step(by_step, trains=trains, maximize=direction == "maximize")
    if step is None:
        raise SweepError(f"{run_dir}/metrics.jsonl has {metric!r} at step 0 (the starting "
                         "policy) only; the objective counts trained steps")
    return by_step[step]


def run_config_matches(cfg) -> bool:
    """Whether cfg.run_dir holds a run of exactly this config (so it can resume or be reused)."""
    from a2tgpo.train.config import TrainConfig

    path = Path(cfg.run_dir) / "config.yaml"
    if not path.exists():
        return False
    try:
        return load_config(TrainConfig, path) == cfg
    except (ConfigError, ValueError):
        return False


def move_aside(run_dir: Path, why: str) -> Path | None:
    """Rename a run folder that cannot be resumed to run.aside-<n> (never deleted)."""
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    n = 1
    while (dest := run_dir.with_name(f"{run_dir.name}.aside-{n}")).exists():
        n += 1
    run_dir.rename(dest)
    log.warning("%s: %s; moved it aside to %s and starting fresh", run_dir, why, dest)
    return dest


def _say(msg: str) -> None:
    """A progress line: on stdout (the Snakemake console) and in the log."""
    print(msg, flush=True)
    log.info(msg)


def _precreate_mlflow_run(cfg, sweep: SweepConfig, index: int, number: int) -> None:
    """Create the trial's MLflow run with its sweep tags before training (the training Tracker
    then resumes it by the run folder's mlflow_run.json and logs the rest)."""
    from a2tgpo.config import format_value
    from a2tgpo.tracking import Tracker
    from a2tgpo.train.rl import run_name

    if not cfg.tracking.mlflow:
        return
    v = trial_values(cfg)
    tags = {"sweep": sweep.name, "trial": str(index), "optuna_trial": str(number),
            "beta": format_value(v["beta"]), "gamma": format_value(v["gamma"]),
            "cell": cfg.cell, "stage": "sweep"}
    # no system metrics: this job does nothing to sample (training's Tracker samples)
    tracker = Tracker(cfg.run_dir, replace(cfg.tracking, system_metrics=False),
                      study=cfg.study, run_name=run_name(cfg), tags=tags,
                      results_dir=cfg.results_dir)
    with tracker:
        pass
    if not tracker.mlflow_enabled:
        log.warning("sweep %s trial %d: MLflow tracking failed (warning above); the trial "
                    "goes on and %s/metrics.jsonl has every metric", sweep.name, index,
                    cfg.run_dir)


def run_trial(sweep: SweepConfig, index: int, base, *, out: str | Path | None = None,
              train_fn: Callable | None = None) -> dict:
    """Trial job `index`: ask (or re-use) → train → objective → tell → result.json."""
    if not 0 <= index < sweep.n_trials:
        raise ConfigError(f"sweep {sweep.name}: --index {index} is outside 0..{sweep.n_trials - 1}")
    check_method(sweep, base.method, f"sweep {sweep.name}")
    directory = sweep_dir(base, sweep)
    trial_dir = directory / "trials" / str(index)
    out = Path(out) if out is not None else trial_dir / RESULT_FILE
    # config errors surface before any Optuna trial exists
    probe = trial_config(base, sweep, index, {})
    # the trial's run folder (its params do not change it) is locked from before the trial is
    # claimed to its result: a second job on this index fails at once and claims nothing, and
    # nothing moves or writes the folder meanwhile (training locks it again: a nested hold)
    with folder_lock(probe.run_dir, f"sweep {sweep.name} trial {index}: run folder"):
        return _run_trial(sweep, index, base, probe, out, train_fn, trial_dir, directory)


def _run_trial(sweep: SweepConfig, index: int, base, probe, out: Path, train_fn,
               trial_dir: Path, directory: Path) -> dict:
    from optuna.trial import TrialState

    n = sweep.n_trials

    def matches(params):
        return run_config_matches(trial_config(base, sweep, index, params)) and \
            (Path(probe.run_dir) / "summary.json").exists()

    t0 = time.perf_counter()
    with ask_lock(directory):
        study = load_study(sweep, directory, sampler=make_sampler(sweep, index),
                           base_hash=config_hash(base))
        claim = claim_trial(study, sweep, index, matches_run=matches, directory=directory)
    cfg = trial_config(base, sweep, index, claim.params)
    values = trial_values(cfg)
    head = f"[sweep {sweep.name}] trial {index + 1}/{n} (Optuna #{claim.number})"
    if claim.reuse:
        _say(f"{head}: already trained ({_fmt(values)}); reusing {cfg.run_dir}")
        value = objective(cfg.run_dir, sweep.metric, sweep.direction,
                          trains=cfg.method.train)
    else:
        run_dir = Path(cfg.run_dir)
        if run_dir.exists() and not run_config_matches(cfg):
            move_aside(run_dir, "its checkpoints belong to a different config (other β/γ, or "
                                "a changed base config or overrides)")
        resume = (f" (same params as failed trial #{claim.retry_of:d}; resuming its run folder)"
                  if claim.retry_of is not None else "")
        _say(f"{head} start: {_fmt(values)}{resume} -> {cfg.run_dir}")
        try:
            _precreate_mlflow_run(cfg, sweep, index, claim.number)
            if train_fn is None:
                from a2tgpo.train.rl import train as train_fn
            train_fn(cfg)
            value = objective(cfg.run_dir, sweep.metric, sweep.direction,
                              trains=cfg.method.train)
        except Exception as e:
            # (KeyboardInterrupt / SystemExit, e.g. preemption, pass through: the trial stays
            # RUNNING, and the rerun of this index fails it and resumes with the same params)
            log.error("sweep %s trial %d: training failed (%s: %s); marking Optuna trial #%d "
                      "FAIL; a rerun retries the same params", sweep.name, index,
                      type(e).__name__, e, claim.number)
            try:
                teller(study).tell(claim.number, state=TrialState.FAIL, skip_if_finished=True)
            except Exception as e2:
                log.error("sweep %s trial %d: Optuna could not mark trial #%d FAIL (%s: %s); "
                          "the rerun treats it as stale", sweep.name, index, claim.number,
                          type(e2).__name__, e2)
            raise
        _optuna(sweep, directory, f"tell (trial #{claim.number}, value {value})",
                lambda: teller(study).tell(claim.number, value, skip_if_finished=True))
    seconds = time.perf_counter() - t0
    result = {"sweep": sweep.name, "index": index, "number": claim.number,
              "params": {p: values[p] for p in sweep.search.searched}, "values": values,
              "metric": sweep.metric, "direction": sweep.direction, "value": value,
              "state": "COMPLETE", "retry_of": claim.retry_of, "reused": claim.reuse,
              "run_dir": cfg.run_dir, "seconds": round(seconds, 1)}
    from a2tgpo.io import atomic_write_json

    atomic_write_json(out, result)
    best = _optuna(sweep, directory, "reading the best trial", lambda: study.best_trial)
    _say(f"{head} done: {sweep.metric} {value:.4f} ({_fmt(values)}) in {seconds:.0f} s; best so "
         f"far {best.value:.4f} (Optuna #{best.number}: {_fmt(best.params)})")
    return result


# --------------------------------------------------------------------------------------------
# the summary


def pick_best(rows: list[dict], direction: str) -> dict:
    """The best result row (ties: the lowest Optuna trial number, as study.best_trial)."""
    sign = 1 if direction == "maximize" else -1
    return min(rows, key=lambda r: (-sign * r["value"], r["number"], r["index"]))


def summarize(sweep: SweepConfig, directory: str | Path, *, plot: bool = True) -> dict:
    """Read trials/<i>/result.json (i < n_trials) and the journal; write summary.json and
    best.png; return the summary."""
    from a2tgpo.io import atomic_write_json

    directory = Path(directory)
    rows, missing = [], []
    for i in range(sweep.n_trials):
        path = directory / "trials" / str(i) / RESULT_FILE
        if path.exists():
            rows.append(json.loads(path.read_text()))
        else:
            missing.append(i)
    if missing:
        raise SweepError(f"sweep {sweep.name}: no {RESULT_FILE} for trials "
                         f"{', '.join(map(str, missing))} under {directory}/trials")
    history = []
    if journal_path(directory).exists():
        study = load_study(sweep, directory)
        history = [{"number": t.number, "index": t.user_attrs.get("index"),
                    "state": t.state.name, "params": dict(t.params), "value": t.value,
                    "retry_of": t.user_attrs.get("retry_of")}
                   for t in study.get_trials(deepcopy=False)]
    best = pick_best(rows, sweep.direction)
    states: dict[str, int] = {}
    for h in history:
        states[h["state"]] = states.get(h["state"], 0) + 1
    summary = {"sweep": sweep.name, "base": to_dict(sweep.base), "metric": sweep.metric,
               "direction": sweep.direction, "n_trials": sweep.n_trials,
               "searched": list(sweep.search.searched),
               "best": {k: best[k] for k in ("index", "number", "params", "values", "value",
                                             "run_dir")},
               "trials": sorted(rows, key=lambda r: r["index"]),
               "optuna": {"trials": len(history), "states": states, "history": history}}
    atomic_write_json(directory / "summary.json", summary)
    if plot:
        plot_sweep(summary, directory / "best.png")
    return summary


def plot_sweep(summary: dict, path: str | Path) -> None:
    """Objective per trial (with the running best) and the β/γ scatter coloured by it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from a2tgpo.io import atomic_path

    rows = summary["trials"]
    idx = [r["index"] for r in rows]
    val = [r["value"] for r in rows]
    better = max if summary["direction"] == "maximize" else min
    running = [better(val[: k + 1]) for k in range(len(val))]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(idx, val, "o", label="trial")
    a.step(idx, running, where="post", label="best so far")
    a.set_xticks(idx)
    a.set_xlabel("trial index")
    a.set_ylabel(summary["metric"])
    a.set_title(f"sweep {summary['sweep']}: {summary['metric']} per trial")
    a.legend()
    beta = [r["values"]["beta"] for r in rows]
    gamma = [r["values"]["gamma"] for r in rows]
    sc = b.scatter(beta, gamma, c=val, cmap="viridis", s=60, edgecolors="k")
    best = summary["best"]
    b.scatter([best["values"]["beta"]], [best["values"]["gamma"]], marker="*", s=300,
              facecolors="none", edgecolors="r", label=f"best ({best['value']:.3f})")
    for r in rows:
        b.annotate(str(r["index"]), (r["values"]["beta"], r["values"]["gamma"]),
                   textcoords="offset points", xytext=(5, 5), fontsize=8)
    fig.colorbar(sc, ax=b, label=summary["metric"])
    b.set_xlabel("β (method.advantage.beta)")
    b.set_ylabel("γ (method.advantage.gamma)")
    b.set_title("β/γ of each trial")
    b.legend(loc="best")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def format_summary(summary: dict) -> str:
    best = summary["best"]
    lines = [(f"sweep {summary['sweep']}: {summary['n_trials']} trials of "
              f"{summary['base']['method']} on {summary['base']['backbone']} (seed "
              f"{summary['base']['seed']}), objective {summary['direction']} {summary['metric']}"),
             f"{'trial':>5}  {'optuna':>6}  {'beta':>8}  {'gamma':>8}  {'value':>8}"]
    for r in summary["trials"]:
        mark = "  <- best" if r["index"] == best["index"] else ""
        lines.append(f"{r['index']:>5}  #{r['number']:>5}  {r['values']['beta']:>8.4g}  "
                     f"{r['values']['gamma']:>8.4g}  {r['value']:>8.4f}{mark}")
    lines.append(f"best: trial {best['index']} (Optuna #{best['number']}): "
                 f"{_fmt(best['values'])} -> {summary['metric']} {best['value']:.4f}")
    states = ", ".join(f"{n} {s}" for s, n in sorted(summary["optuna"]["states"].items()))
    lines.append(f"Optuna study: {summary['optuna']['trials']} trials ({states or 'none'})")
    return "\n".join(lines)


def redirect_to_log(path: str | Path) -> None:
    """Send stderr (logging, tqdm, warnings) to `path`; stdout keeps the progress lines."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    os.dup2(fd, 2)
    os.close(fd)


