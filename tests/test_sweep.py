"""Optuna β/γ sweeps (a2tgpo/sweep.py): config validation, the restart path (stale RUNNING
trials failed and their params re-enqueued), trial jobs with a stand-in for training, the
summary, and the Snakemake targets."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from a2tgpo.algo.methods import get_method
from a2tgpo.config import ConfigError, dump_config, load_config
from a2tgpo.model.backbone import BackboneConfig
from a2tgpo.tracking import TrackingConfig
from a2tgpo.train.config import ScheduleConfig, TrainConfig

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402

from a2tgpo import sweep as sw  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SWEEP = {"name": "s", "base": {"backbone": "toy", "method": "a2tgpo", "seed": 1},
         "n_trials": 4, "search": {"beta": {"low": 0.0, "high": 0.5},
                                   "gamma": {"low": 0.8, "high": 1.0}},
         "overrides": ["schedule.steps=2"]}


def write_sweep(tmp_path, data=None, **changes) -> Path:
    data = {**(data or SWEEP), **changes}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def make_sweep(tmp_path, **changes) -> sw.SweepConfig:
    return sw.load_sweep(write_sweep(tmp_path, **changes))


def base_config(tmp_path) -> TrainConfig:
    """A base cell's resolved config (the stand-in training reads nothing from its files)."""
    results = tmp_path / "results" / "t"
    return TrainConfig(
        run_dir=str(results / "runs" / "backbone~toy/method~a2tgpo/beta~0.3/seed~1"),
        results_dir=str(results), study="t", cell="backbone~toy/method~a2tgpo/beta~0.3/seed~1",
        backbone=BackboneConfig(id="toy", path="unused"), method=get_method("a2tgpo"),
        train_file="unused", dev_file="unused", corpus="unused",
        schedule=ScheduleConfig(steps=8), tracking=TrackingConfig(mlflow=False))


def em_of(beta, gamma):
    """The stand-in objective: best at β = 0.3, γ = 1."""
    return round(1.0 - (beta - 0.3) ** 2 - (1.0 - gamma), 6)


class FakeTrain:
    """Stands in for a2tgpo.train.rl.train: writes config.yaml, metrics.jsonl (val/em at steps
    0 and `steps`) and summary.json like the real loop; records what it was given."""

    def __init__(self, fail=None):
        self.calls = []
        self.fail = fail  # an exception to raise after config.yaml (a crash mid-training)

    def __call__(self, cfg):
        run = Path(cfg.run_dir)
        resumed = (run / "config.yaml").exists()
        self.calls.append((cfg, resumed))
        run.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run / "config.yaml")
        if self.fail is not None:
            with open(run / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": 0, "val/em": 0.0}) + "\n")
            raise self.fail
        a = cfg.method.advantage
        em = em_of(a.beta, a.gamma)
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 0, "val/em": 0.1}) + "\n")
            f.write(json.dumps({"step": cfg.schedule.steps, "val/em": em}) + "\n")
        summary = {"steps": cfg.schedule.steps, "best_step": cfg.schedule.steps,
                   "best_val_em": em}
        (run / "summary.json").write_text(json.dumps(summary))
        return summary


# --------------------------------------------------------------------------------------------
# config


def test_toy_sweep_config_loads_and_is_listed_but_not_default():
    cfg = sw.load_sweep(ROOT / "config" / "sweeps" / "toy.yaml")
    assert cfg.name == "toy" and cfg.n_trials >= 2
    assert cfg.search.searched == ("beta", "gamma")
    sw.check_method(cfg, get_method(cfg.base.method), "toy.yaml")
    study = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    assert study["sweeps"] == ["config/sweeps/toy.yaml"]


@pytest.mark.parametrize("changes, needle", [
    ({"n_trail": 3}, "n_trail: unknown key (did you mean 'n_trials'?)"),
    ({"n_trials": 0}, "n_trials: 0 is out of range: must be >= 1"),
    ({"name": "Big Sweep"}, "use lowercase letters"),
    ({"name": "trial"}, "reserved"),
    ({"search": {"beta": {"low": 0.5, "high": 0.1}}}, "low (0.5) must be < high (0.1)"),
    ({"search": {"beta": {"low": 0.1}}}, "give both low and high"),
    ({"search": {"beta": {"low": 0.0, "high": 0.5, "fixed": 0.3}}}, "either fixed or low/high"),
    ({"search": {"beta": {"fixed": 0.3}}}, "search at least one of beta, gamma"),
    ({"search": {"gamma": {"low": 0.5, "high": 1.5}}}, "gamma: 1.5 is outside [0.0, 1.0]"),
    ({"search": {"beta": {"low": -0.1, "high": 0.5}}}, "beta: -0.1 is outside"),
    ({"search": {"beta": {"low": 0.0, "high": 0.5, "step": 0.2}}}, "not a multiple of step"),
    ({"search": {"beta": {"low": 0.0, "high": 0.5, "step": "x"}}}, "search.beta.step: expected"),
    ({"sampler": {"kind": "grid"}}, "sampler grid: search.beta needs a step"),
    ({"sampler": {"kind": "grid"}, "n_trials": 7,
      "search": {"beta": {"low": 0.0, "high": 0.5, "step": 0.1}}}, "6 points but n_trials is 7"),
    ({"sampler": {"kind": "cmaes"}}, "sampler.kind: expected one of 'tpe', 'grid'"),
    ({"direction": "max"}, "direction: expected one of"),
    ({"overrides": ["method.advantage.beta=0.2"]}, "method.advantage.beta is set by the sweep"),
    ({"overrides": ["run_dir=/tmp/x"]}, "run_dir is set by the sweep"),
    ({"overrides": ["schedule.steps"]}, "expected dotted.key=value"),
    ({"base": {"method": "a2tgpo"}}, "base.backbone: missing required key"),
    # the objective is read from validation rows: a typo, or a key only training rows carry,
    # would fail after a whole trial's training
    ({"metric": "val/emm"}, ("metric: 'val/emm' is not a metric validation writes to "
                            "metrics.jsonl (did you mean 'val/em'?); one of val/em, val/f1")),
    ({"metric": "train/reward"}, "metric: 'train/reward' is not a metric validation writes"),
    ({"metric": "val/outcome/bridge/correctt"}, "(did you mean 'val/outcome/correct'?)"),
])
def test_sweep_config_errors(tmp_path, changes, needle):
    with pytest.raises(ConfigError) as e:
        make_sweep(tmp_path, **changes)
    assert needle in str(e.value)
    assert str(tmp_path / "s.yaml") in str(e.value)  # the message names the file


@pytest.mark.parametrize("metric", ["val/em", "val/f1", "val/tool_calls", "val/outcome/limit",
                                    "val/outcome/bridge/query_missed", "val/seconds"])
def test_every_metric_validation_writes_is_an_objective(tmp_path, metric):
    assert make_sweep(tmp_path, metric=metric).metric == metric


def test_validation_metrics_are_the_keys_validate_writes(monkeypatch):
    """validate() on two stand-in dev trajectories (bridge questions) writes exactly the keys
    validation_metrics() lists, with * the data's hop type."""
    import fnmatch
    from types import SimpleNamespace

    from a2tgpo.rollout.agent import Question
    from a2tgpo.train import rl

    trajs = [SimpleNamespace(extra={"em": em, "f1": em, "format_ok": True, "answer": "a"},
                             num_tool_calls=1, question_id="q", golden_answers=["a"],
                             turns=[SimpleNamespace(stop="answer", obs_ids=())])
             for em in (0.0, 1.0)]
    monkeypatch.setattr(rl, "_rollout", lambda run, qs, **kw: trajs)
    monkeypatch.setattr(rl, "score", lambda cfg, tok, t, training: t)
    monkeypatch.setattr(rl, "_gather", lambda backend, t: t)
    run = SimpleNamespace(
        cfg=SimpleNamespace(method=SimpleNamespace(train=True)), dev_qs=["q"], main=False,
        backend=SimpleNamespace(unwrapped=SimpleNamespace(eval=lambda: None)),
        placement=SimpleNamespace(share=lambda qs: qs), best={"step": None},
        tok=SimpleNamespace(decode=lambda ids, **kw: ""),
        questions={"q": Question(id="q", question="?", golden_answers=("a",), hops=2,
                                 hop_type="bridge")})
    written = rl.validate(run, 3)
    assert written["val/em"] == 0.5  # mean of the two EMs, 0 and 1
    patterns = rl.validation_metrics()
    assert {k for k in written if not any(fnmatch.fnmatchcase(k, p) for p in patterns)} == set()
    assert {p.replace("*", "bridge") for p in patterns} == set(written)


def test_a_journal_made_with_a_metric_no_run_writes_does_not_block_the_fix(tmp_path):
    """A journal whose study records a metric no run writes (made before the file check): its
    trials all failed at the objective, so the corrected metric is recorded and the failed
    trial is retried with its params in its run folder; any other change is still refused."""
    base, good = base_config(tmp_path), make_sweep(tmp_path)
    typo = dataclasses.replace(good, metric="val/emm")
    with pytest.raises(sw.SweepError, match="has no value of 'val/emm'"):
        sw.run_trial(typo, 0, base, train_fn=FakeTrain())
    d = sw.sweep_dir(base, good)
    (failed,) = sw.load_study(typo, d).trials
    assert failed.state == TrialState.FAIL
    wider = make_sweep(tmp_path, search={"beta": {"low": 0.0, "high": 0.9},
                                         "gamma": {"low": 0.8, "high": 1.0}})
    with pytest.raises(ConfigError, match=r"changed: metric, search.beta.high\)"):
        sw.run_trial(wider, 0, base, train_fn=FakeTrain())
    train = FakeTrain()
    result = sw.run_trial(good, 0, base, train_fn=train)
    assert result["retry_of"] == failed.number and result["params"] == failed.params
    assert train.calls[0][1]  # its run folder, resumed
    assert sw.load_study(good, d).user_attrs["sweep_config"]["metric"] == "val/em"
    # a metric that runs write is a real choice: changing it stays refused
    f1 = dataclasses.replace(good, metric="val/f1")
    with pytest.raises(ConfigError, match=r"changed: metric\)"):
        sw.load_study(f1, d)


def test_method_must_read_the_searched_keys(tmp_path):
    cfg = make_sweep(tmp_path)
    with pytest.raises(ConfigError, match="method 'grpo' .* does not read beta"):
        sw.check_method(cfg, get_method("grpo"), "s.yaml")
    gamma_only = make_sweep(tmp_path, search={"gamma": {"low": 0.8, "high": 1.0}})
    sw.check_method(gamma_only, get_method("gigpo"), "s.yaml")  # GiGPO reads γ, not β
    # IGPO's estimator reads γ, but β only with adaptive clipping, which it has not
    with pytest.raises(ConfigError, match=r"^config/sweeps/s.yaml: search.beta: method 'igpo' "
                       r"\(advantage estimator 'igpo_family', loss.adaptive_clip false\) does "
                       r"not read beta; it needs loss.adaptive_clip: true$"):
        sw.check_method(cfg, get_method("igpo"), "config/sweeps/s.yaml")
    sw.check_method(gamma_only, get_method("igpo"), "s.yaml")
    # a method that reads neither: refused for either key
    with pytest.raises(ConfigError, match=r"^config/sweeps/s.yaml: search.gamma: method "
                       r"'grpo' .* does not read gamma; it needs advantage.estimator "):
        sw.check_method(gamma_only, get_method("grpo"), "config/sweeps/s.yaml")


def test_trial_config_applies_overrides_params_and_paths(tmp_path):
    base = base_config(tmp_path)
    cfg = sw.trial_config(base, make_sweep(tmp_path, search={
        "beta": {"low": 0.0, "high": 0.5}, "gamma": {"fixed": 0.9}}), 2, {"beta": 0.25})
    assert cfg.run_dir == f"{base.results_dir}/sweeps/s/trials/2/run"
    assert cfg.cell == "sweep~s/trial~2"
    assert (cfg.method.advantage.beta, cfg.method.advantage.gamma) == (0.25, 0.9)
    assert cfg.schedule.steps == 2  # the sweep's override
    assert cfg.method.id == "a2tgpo" and cfg.results_dir == base.results_dir
    with pytest.raises(ConfigError, match="schedule.stepz: unknown key"):
        sw.trial_config(base, make_sweep(tmp_path, overrides=["schedule.stepz=2"]), 0, {})


def test_grid_points_are_exact(tmp_path):
    r = sw.ParamRange(low=0.0, high=0.5, step=0.1)
    assert r.grid() == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]  # not 0.30000000000000004


# --------------------------------------------------------------------------------------------
# the restart path


def test_stale_running_trial_is_failed_and_its_params_reenqueued(tmp_path, caplog):
    """A job for index 1 was killed mid-training: its Optuna trial is still RUNNING. The next
    job for index 1 marks it FAIL and gets a new trial with the same β/γ; index 0's RUNNING
    trial (a job still at work) is left alone."""
    cfg = make_sweep(tmp_path)
    d2 = tmp_path / "sweep"
    # hand-checkable setup: two jobs asked trials with known β/γ, then were killed
    study = sw.load_study(cfg, d2)
    for index, beta, gamma in ((0, 0.1, 0.85), (1, 0.2, 0.9)):
        study.enqueue_trial({"beta": beta, "gamma": gamma}, user_attrs={"index": index})
        t = study.ask()
        t.suggest_float("beta", 0.0, 0.5)
        t.suggest_float("gamma", 0.8, 1.0)
    assert [t.state for t in study.trials] == [TrialState.RUNNING] * 2

    # the restarted job of index 1 (a fresh process: a fresh study object on the same file)
    with sw.ask_lock(d2):
        again = sw.load_study(cfg, d2, sampler=sw.make_sampler(cfg, 1))
        claim = sw.claim_trial(again, cfg, 1, directory=d2)
    trials = sw.load_study(cfg, d2).trials
    assert [t.state for t in trials] == [TrialState.RUNNING, TrialState.FAIL, TrialState.RUNNING]
    assert trials[1].params == {"beta": 0.2, "gamma": 0.9}
    assert claim.params == {"beta": 0.2, "gamma": 0.9} == trials[2].params
    assert claim.retry_of == 1 and claim.number == 2 and not claim.reuse
    assert trials[2].user_attrs == {"index": 1, "sweep": "s", "retry_of": 1}
    assert "Optuna trial #1 (params beta=0.2, gamma=0.9) is still RUNNING" in caplog.text
    assert "marking it FAIL" in caplog.text


def test_killed_trial_resumes_with_same_params(tmp_path, capsys):
    """run_trial end to end: a 'kill' (KeyboardInterrupt, as SIGINT; SIGKILL leaves the same
    state) mid-training leaves the trial RUNNING and the run folder; the rerun fails the stale
    trial, repeats its β/γ and resumes the same folder (nothing moved aside)."""
    cfg, base = make_sweep(tmp_path), base_config(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        sw.run_trial(cfg, 1, base, train_fn=FakeTrain(fail=KeyboardInterrupt()))
    d = sw.sweep_dir(base, cfg)
    (first,) = sw.load_study(cfg, d).trials
    assert first.state == TrialState.RUNNING and first.user_attrs["index"] == 1
    assert not (d / "trials/1/result.json").exists()

    train = FakeTrain()
    result = sw.run_trial(cfg, 1, base, train_fn=train)
    (given, resumed), = train.calls
    assert resumed  # the same run folder, so real training resumes its checkpoints
    assert sw.trial_values(given) == {p: first.params[p] for p in ("beta", "gamma")}
    assert not list((d / "trials/1").glob("run.aside-*"))
    assert result["retry_of"] == first.number and result["state"] == "COMPLETE"
    assert result["value"] == em_of(first.params["beta"], first.params["gamma"])
    assert json.loads((d / "trials/1/result.json").read_text()) == result
    states = [t.state for t in sw.load_study(cfg, d).trials]
    assert states == [TrialState.FAIL, TrialState.COMPLETE]
    out = capsys.readouterr().out  # one line at the start, one at the end
    assert "[sweep s] trial 2/4 (Optuna #1) start: beta=" in out
    assert "resuming its run folder" in out
    assert "[sweep s] trial 2/4 (Optuna #1) done: val/em" in out


def test_training_error_fails_trial_and_rerun_retries_same_params(tmp_path):
    cfg, base = make_sweep(tmp_path), base_config(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        sw.run_trial(cfg, 0, base, train_fn=FakeTrain(fail=RuntimeError("boom")))
    d = sw.sweep_dir(base, cfg)
    (first,) = sw.load_study(cfg, d).trials
    assert first.state == TrialState.FAIL
    result = sw.run_trial(cfg, 0, base, train_fn=FakeTrain())
    assert result["retry_of"] == 0 and result["params"] == first.params


def _two_trials(cfg, d):
    """A study in `d` with trial 0 RUNNING (asked) and trial 1 COMPLETE."""
    study = sw.load_study(cfg, d)
    for value in (None, 0.5):
        t = study.ask()
        t.suggest_float("beta", 0.0, 0.5)
        t.suggest_float("gamma", 0.8, 1.0)
        if value is not None:
            study.tell(t, value)


def test_a_journal_cut_mid_line_by_a_crash_is_repaired_before_the_next_append(tmp_path,
                                                                              caplog):
    """A job killed while appending leaves half an operation at the end of journal.log.
    Optuna skips it on reading, but would append the next operation to it, and that glued
    line would fail every later read. The next append cuts it first, keeping its bytes in
    journal.log.partial: the study takes new trials and opens again."""
    cfg, d = make_sweep(tmp_path), tmp_path / "sweep"
    _two_trials(cfg, d)
    journal = sw.journal_path(d)
    whole = journal.read_bytes()
    half = b'{"op_code":6,"worker_id":"w","trial_id":0,"state":1,"val'  # a tell, cut short
    with open(journal, "ab") as f:
        f.write(half)

    study = sw.load_study(cfg, d)  # another job: a fresh study object on the file
    assert [t.state for t in study.trials] == [TrialState.RUNNING, TrialState.COMPLETE]
    t = study.ask()  # the first append: cuts the half line, then writes
    t.suggest_float("beta", 0.0, 0.5)
    t.suggest_float("gamma", 0.8, 1.0)
    study.tell(t, 0.25)
    states = [t.state for t in sw.load_study(cfg, d).trials]
    assert states == [TrialState.RUNNING, TrialState.COMPLETE, TrialState.COMPLETE]
    assert journal.read_bytes().startswith(whole)
    assert (d / "journal.log.partial").read_bytes() == half + b"\n"
    # the half line was line (whole's lines + 1) of the journal
    line = whole.count(b"\n") + 1
    assert f"journal.log:{line}: cut an unfinished last line ({len(half)} bytes" in caplog.text
    # a job that opens the study while the half line is there cuts it too (under the lock)
    with open(journal, "ab") as f:
        f.write(half)
    sw.load_study(cfg, d)
    assert journal.read_bytes().endswith(b"\n")
    assert (d / "journal.log.partial").read_bytes() == 2 * (half + b"\n")


def test_a_damaged_line_inside_the_journal_is_an_error_naming_it(tmp_path):
    cfg, d = make_sweep(tmp_path), tmp_path / "sweep"
    _two_trials(cfg, d)
    journal = sw.journal_path(d)
    lines = journal.read_bytes().split(b"\n")
    lines[1] = lines[1][:-3]  # line 2 loses its last 3 bytes but keeps its newline
    journal.write_bytes(b"\n".join(lines))
    damaged = journal.read_bytes()
    with pytest.raises(sw.SweepError, match=r"journal.log:2: not valid JSON: .*the sweep's "
                       "Optuna journal is damaged there"):
        sw.load_study(cfg, d)
    assert journal.read_bytes() == damaged  # nothing was cut or appended
    assert not (d / "journal.log.partial").exists()


def test_run_folder_of_other_params_is_moved_aside(tmp_path):
    cfg, base = make_sweep(tmp_path), base_config(tmp_path)
    other = sw.trial_config(base, cfg, 2, {"beta": 0.123, "gamma": 0.8})
    Path(other.run_dir).mkdir(parents=True)
    dump_config(other, Path(other.run_dir) / "config.yaml")
    (Path(other.run_dir) / "checkpoints").mkdir()
    train = FakeTrain()
    sw.run_trial(cfg, 2, base, train_fn=train)
    assert train.calls[0][1] is False  # started fresh
    aside = Path(other.run_dir).with_name("run.aside-1")
    assert (aside / "checkpoints").is_dir()  # kept, not deleted
    assert load_config(TrainConfig, aside / "config.yaml") == other


def test_complete_trial_is_reused_not_retrained(tmp_path):
    """The job was killed after tell but before result.json: the rerun writes it from the run."""
    cfg, base = make_sweep(tmp_path), base_config(tmp_path)
    first = sw.run_trial(cfg, 3, base, train_fn=FakeTrain())
    Path(first["run_dir"]).parent.joinpath("result.json").unlink()
    train = FakeTrain()
    again = sw.run_trial(cfg, 3, base, train_fn=train)
    assert not train.calls and again["reused"]
    assert (again["number"], again["params"], again["value"]) == \
        (first["number"], first["params"], first["value"])
    assert len(sw.load_study(cfg, sw.sweep_dir(base, cfg)).trials) == 1


def test_changed_sweep_config_is_refused(tmp_path):
    base = base_config(tmp_path)
    sw.run_trial(make_sweep(tmp_path), 0, base, train_fn=FakeTrain())
    wider = make_sweep(tmp_path, n_trials=6, search={"beta": {"low": 0.0, "high": 0.9},
                                                     "gamma": {"low": 0.8, "high": 1.0}})
    with pytest.raises(ConfigError, match=r"different sweep config \(changed: "
                                          r"search.beta.high\)"):
        sw.run_trial(wider, 1, base, train_fn=FakeTrain())
    # n_trials may grow
    sw.run_trial(make_sweep(tmp_path, n_trials=6), 5, base, train_fn=FakeTrain())


def test_index_out_of_range(tmp_path):
    with pytest.raises(ConfigError, match="outside 0..3"):
        sw.run_trial(make_sweep(tmp_path), 4, base_config(tmp_path), train_fn=FakeTrain())


# --------------------------------------------------------------------------------------------
# objective and summary


def test_objective_reads_metrics_with_resumed_rows_winning(tmp_path):
    rows = [{"step": 0, "val/em": 0.2}, {"step": 4, "val/em": 0.9},  # step 4 lost in a kill,
            {"step": 4, "val/em": 0.5}, {"step": 8, "val/em": 0.4}]  # redone after resume
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert sw.objective(tmp_path, "val/em", "maximize", trains=True) == 0.5
    # trained steps only: {4: 0.5, 8: 0.4} -> min 0.4 (step 0's 0.2 is the starting policy)
    assert sw.objective(tmp_path, "val/em", "minimize", trains=True) == 0.4
    # a method that does not train: step 0 counts
    assert sw.objective(tmp_path, "val/em", "minimize", trains=False) == 0.2
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/em": 0.2}) + "\n")
    with pytest.raises(sw.SweepError, match="at step 0 .* only"):  # nothing trained yet
        sw.objective(tmp_path, "val/em", "maximize", trains=True)
    with pytest.raises(sw.SweepError, match="no value of 'val/f1'"):
        sw.objective(tmp_path, "val/f1", "maximize", trains=True)
    with pytest.raises(sw.SweepError, match="no metrics.jsonl"):
        sw.objective(tmp_path / "nothing", "val/em", "maximize", trains=True)


def test_pick_best():
    rows = [{"index": 0, "number": 0, "value": 0.3}, {"index": 1, "number": 3, "value": 0.5},
            {"index": 2, "number": 2, "value": 0.5}, {"index": 3, "number": 1, "value": 0.1}]
    assert sw.pick_best(rows, "maximize")["index"] == 2  # ties: the first Optuna trial
    assert sw.pick_best(rows, "minimize")["index"] == 3


def test_sweep_end_to_end_with_standin_training_and_summary(tmp_path, capsys):
    """Four trials (as four jobs would run them), then the summary picks the best one."""
    cfg, base = make_sweep(tmp_path), base_config(tmp_path)
    results = [sw.run_trial(cfg, i, base, train_fn=FakeTrain()) for i in range(4)]
    params = {(r["params"]["beta"], r["params"]["gamma"]) for r in results}
    assert len(params) == 4  # per-index sampler seeds: no repeated start-up points
    d = sw.sweep_dir(base, cfg)
    summary = sw.summarize(cfg, d)
    want = max(results, key=lambda r: r["value"])
    assert summary["best"]["index"] == want["index"]
    assert summary["best"]["value"] == want["value"] == max(r["value"] for r in results)
    assert summary["best"]["params"] == want["params"]
    assert [t["index"] for t in summary["trials"]] == [0, 1, 2, 3]
    assert summary["optuna"]["states"] == {"COMPLETE": 4}
    assert json.loads((d / "summary.json").read_text()) == summary
    assert (d / "best.png").read_bytes()[:4] == b"\x89PNG"
    text = sw.format_summary(summary)
    assert f"best: trial {want['index']} (Optuna #{want['number']})" in text
    (d / "trials/2/result.json").unlink()
    with pytest.raises(sw.SweepError, match="no result.json for trials 2"):
        sw.summarize(cfg, d, plot=False)


def test_grid_sampler_covers_the_grid(tmp_path):
    cfg = make_sweep(tmp_path, n_trials=4, sampler={"kind": "grid"}, search={
        "beta": {"low": 0.1, "high": 0.4, "step": 0.1}, "gamma": {"fixed": 1.0}})
    base = base_config(tmp_path)
    got = sorted(sw.run_trial(cfg, i, base, train_fn=FakeTrain())["params"]["beta"]
                 for i in range(4))
    assert got == [0.1, 0.2, 0.3, 0.4]
    summary = sw.summarize(cfg, sw.sweep_dir(base, cfg), plot=False)
    assert summary["best"]["params"] == {"beta": 0.3}


def test_parallel_trial_jobs_share_the_journal(tmp_path):
    """Two processes ask, train (stand-in) and tell at once: four distinct COMPLETE trials."""
    cfg_path = write_sweep(tmp_path)
    base = base_config(tmp_path)
    base_path = tmp_path / "base.yaml"
    dump_config(base, base_path)
    script = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_sweep import FakeTrain\n"
        "from a2tgpo import sweep as sw\n"
        "from a2tgpo.config import load_config\n"
        "from a2tgpo.train.config import TrainConfig\n"
        f"cfg = sw.load_sweep({str(cfg_path)!r}); "
        f"base = load_config(TrainConfig, {str(base_path)!r})\n"
        "for i in map(int, sys.argv[1:]):\n"
        "    sw.run_trial(cfg, i, base, train_fn=FakeTrain())\n"
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, *ix], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for ix in (["0", "2"], ["1", "3"])]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    trials = sw.load_study(sw.load_sweep(cfg_path), sw.sweep_dir(base, sw.load_sweep(cfg_path))
                           ).trials
    assert sorted(t.user_attrs["index"] for t in trials) == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE for t in trials)
    assert len({(t.params["beta"], t.params["gamma"]) for t in trials}) == 4


# --------------------------------------------------------------------------------------------
# the DAG


def test_snakemake_plans_the_sweep_target(tmp_path):
    """`snakemake sweep_toy` plans n_trials trial jobs and the summary; the default target
    has no sweep job."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    results = tmp_path / "results"
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["results_dir"] = str(results)
    for source in cfg["data"]["train"] + cfg["data"]["test"]:  # the toy world's QA folder
        source["repo"] = source["repo"].replace("results/", f"{results}/", 1)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    smk = [str(Path(sys.executable).parent / "snakemake"), "-n", "--quiet", "rules",
           "--configfile", str(tmp_path / "config.yaml"), "--"]
    r = subprocess.run([*smk, "sweep_toy"], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    n = sw.load_sweep(ROOT / "config/sweeps/toy.yaml").n_trials
    assert f"sweep_trial              {n}" in out or f"sweep_trial {n}" in " ".join(out.split())
    for rule in ("sweep_base_config", "sweep_summary", "sweep_toy", "mlflow_experiment"):
        assert rule in out
    r = subprocess.run(smk, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "sweep_trial" not in r.stdout + r.stderr
    assert not (tmp_path / "results").exists()


def test_a_trial_whose_run_folder_is_in_use_fails_at_once_and_claims_nothing(tmp_path):
    # another job (a rerun while an orphan still trains) holds trial 1's run folder
    from a2tgpo.ops.lock import FolderBusy

    cfg, base = make_sweep(tmp_path), base_config(tmp_path)
    run = Path(sw.trial_config(base, cfg, 1, {}).run_dir)
    code = ("import sys, time\nfrom a2tgpo.ops.lock import folder_lock\n"
            "with folder_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        train = FakeTrain()
        with pytest.raises(FolderBusy, match=f"sweep s trial 1: run folder {run} is in use by "
                                             f"pid {holder.pid}"):
            sw.run_trial(cfg, 1, base, train_fn=train)
        assert train.calls == []
        d = sw.sweep_dir(base, cfg)
        # no Optuna trial was claimed for it (the journal may not even exist yet)
        assert not sw.journal_path(d).exists() or sw.load_study(cfg, d).trials == []
    finally:
        holder.kill()
        holder.wait()
    assert sw.run_trial(cfg, 1, base, train_fn=FakeTrain())["state"] == "COMPLETE"
