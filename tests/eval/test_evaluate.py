"""Evaluation: sample-weighted averages by hand, input checks, and one end-to-end run of
`a2tgpo evaluate` on the tiny toy cell (tests/eval/conftest.py)."""

import json
import math

import pytest

from a2tgpo.eval.evaluate import group_averages, load_test_sets, mean_metrics, write_results
from a2tgpo.io import read_jsonl


def _write_parquet(path, rows):
    from a2tgpo.data.qa import _write_rows

    path.parent.mkdir(parents=True, exist_ok=True)
    full = [{"id": r["id"], "question": r.get("question", "q?"),
             "golden_answers": r.get("golden_answers", ["x"]), "source": "s", "split": "test",
             "group": r["group"], "hop_type": None, "hops": None} for r in rows]
    _write_rows(path, full)
    return path


# --------------------------------------------------------------------------------------------
# averages by hand


def test_group_averages_are_sample_weighted():
    # multi_hop: A has 3 questions (EM 1, 1, 0), B has 1 (EM 0); single_hop: C has 2 (EM 1, 0)
    preds = {"A": [{"em": 1.0, "f1": 1.0}, {"em": 1.0, "f1": 0.5}, {"em": 0.0, "f1": 0.0}],
             "B": [{"em": 0.0, "f1": 0.25}],
             "C": [{"em": 1.0, "f1": 1.0}, {"em": 0.0, "f1": 0.5}]}
    groups = {"A": "multi_hop", "B": "multi_hop", "C": "single_hop"}
    out = group_averages(preds, groups)
    # multi_hop EM = (1+1+0+0)/4 = 0.5; the mean of dataset means would be (2/3 + 0)/2 = 1/3
    assert out["multi_hop"]["n"] == 4 and out["multi_hop"]["em"] == pytest.approx(0.5)
    # multi_hop F1 = (1 + 0.5 + 0 + 0.25)/4 = 0.4375
    assert out["multi_hop"]["f1"] == pytest.approx(0.4375)
    # single_hop EM = (1+0)/2 = 0.5, F1 = (1+0.5)/2 = 0.75
    assert out["single_hop"] == pytest.approx({"n": 2, "em": 0.5, "f1": 0.75})
    # all: EM = (1+1+0+0+1+0)/6 = 0.5; F1 = (1+0.5+0+0.25+1+0.5)/6 = 3.25/6
    assert out["all"]["n"] == 6 and out["all"]["em"] == pytest.approx(0.5)
    assert out["all"]["f1"] == pytest.approx(3.25 / 6)
    assert list(out) == ["multi_hop", "single_hop", "all"]


def test_written_summary_uses_weighted_group_means(tmp_path):
    # datasets of 3 and 1 questions, one group: EM 3/3 and 0/1 -> group 3/4, not (1 + 0)/2
    a = _write_parquet(tmp_path / "in" / "a.parquet",
                       [{"id": f"a{i}", "group": "multi_hop"} for i in range(3)])
    b = _write_parquet(tmp_path / "in" / "b.parquet", [{"id": "b0", "group": "multi_hop"}])
    sets = load_test_sets([a, b])
    row = {"f1": 0.0, "format_ok": True, "tool_calls": 2}
    preds = {"a": [{**row, "em": 1.0}] * 3, "b": [{**row, "em": 0.0, "tool_calls": 0}]}
    out = tmp_path / "eval"
    summary = write_results(out, sets, preds, step=20, checkpoint="checkpoints/step_000020/model",
                            criterion="dev_em", label="dev EM")
    assert summary["groups"]["multi_hop"] == pytest.approx({"n": 4, "em": 0.75, "f1": 0.0})
    assert summary["groups"]["all"]["em"] == pytest.approx(0.75)
    assert json.loads((out / "summary.json").read_text()) == summary
    rec = json.loads((out / "a.json").read_text())
    assert rec == {"dataset": "a", "group": "multi_hop", "n": 3, "em": 1.0, "f1": 0.0,
                   "format_ok": 1.0, "tool_calls": 2.0, "step": 20,
                   "checkpoint": "checkpoints/step_000020/model", "criterion": "dev_em",
                   "failed": 0}
    assert json.loads((out / "b.json").read_text())["tool_calls"] == 0.0
    assert len(read_jsonl(out / "a.predictions.jsonl")) == 3
    assert sorted(p.name for p in out.iterdir()) == [
        "a.json", "a.predictions.jsonl", "b.json", "b.predictions.jsonl", "summary.json"]


def test_rewrite_replaces_the_whole_directory(tmp_path):
    a = _write_parquet(tmp_path / "in" / "a.parquet", [{"id": "a0", "group": "g"}])
    b = _write_parquet(tmp_path / "in" / "b.parquet", [{"id": "b0", "group": "g"}])
    row = {"em": 1.0, "f1": 1.0, "format_ok": True, "tool_calls": 1}
    out = tmp_path / "eval"
    kw = dict(step=0, checkpoint="c", criterion=None, label="step 0")
    write_results(out, load_test_sets([a, b]), {"a": [row], "b": [row]}, **kw)
    write_results(out, load_test_sets([a]), {"a": [row]}, **kw)
    # no stale b.json from the first run, and no temporary leftovers
    assert sorted(p.name for p in out.iterdir()) == ["a.json", "a.predictions.jsonl",
                                                     "summary.json"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_prediction_count_must_match_the_dataset(tmp_path):
    a = _write_parquet(tmp_path / "a.parquet", [{"id": "a0", "group": "g"},
                                                {"id": "a1", "group": "g"}])
    with pytest.raises(ValueError, match="a.parquet: 1 predictions for 2 questions"):
        write_results(tmp_path / "eval", load_test_sets([a]),
                      {"a": [{"em": 1.0, "f1": 1.0, "format_ok": 1, "tool_calls": 0}]},
                      step=0, checkpoint="c", criterion=None, label="x")
    assert not (tmp_path / "eval").exists()


def test_mean_of_no_rows_is_zero_not_nan():
    assert mean_metrics([]) == {"n": 0, "em": 0.0, "f1": 0.0}


# --------------------------------------------------------------------------------------------
# input checks


def test_dataset_without_group_names_the_file_and_row(tmp_path):
    p = _write_parquet(tmp_path / "nogroup.parquet", [{"id": "x0", "group": "multi_hop"},
                                                      {"id": "x1", "group": ""}])
    with pytest.raises(ValueError, match=r"nogroup.parquet: row 1 \(id 'x1'\) has no group"):
        load_test_sets([p])


def test_mixed_groups_duplicate_names_and_ids_are_errors(tmp_path):
    mixed = _write_parquet(tmp_path / "mixed.parquet", [{"id": "m0", "group": "multi_hop"},
                                                        {"id": "m1", "group": "single_hop"}])
    with pytest.raises(ValueError, match=r"mixed.parquet: rows of several groups"):
        load_test_sets([mixed])
    a = _write_parquet(tmp_path / "a.parquet", [{"id": "q", "group": "g"}])
    same_stem = _write_parquet(tmp_path / "other" / "a.parquet", [{"id": "r", "group": "g"}])
    with pytest.raises(ValueError, match="dataset name 'a'"):
        load_test_sets([a, same_stem])
    dup = _write_parquet(tmp_path / "b.parquet", [{"id": "q", "group": "g"}])
    with pytest.raises(ValueError, match=r"b.parquet: row 0: id 'q' also in .*a.parquet"):
        load_test_sets([a, dup])
    reserved = _write_parquet(tmp_path / "c.parquet", [{"id": "c", "group": "all"}])
    with pytest.raises(ValueError, match="reserved"):
        load_test_sets([reserved])
    empty = _write_parquet(tmp_path / "e.parquet", [])
    with pytest.raises(ValueError, match="e.parquet: no questions"):
        load_test_sets([empty])
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        load_test_sets([tmp_path / "missing.parquet"])


# --------------------------------------------------------------------------------------------
# one question never takes the evaluation down

LONG = "Why " * 25_000  # 100,000 characters, far over any prompt budget


class AnswerEngine:
    """Answers every prompt at once with `\\boxed{Foo}`; raises `error` for a batch holding a
    prompt that contains "boom" (as a batch that runs out of memory does). Records the rows
    of each call and the longest prompt it was given."""

    def __init__(self, tok, error: Exception | None = None):
        self.tok, self.error, self.batches, self.longest = tok, error, [], 0
        self.ids = tuple(tok.encode("<think> x </think> <answer> \\boxed{Foo} </answer>",
                                    add_special_tokens=False))

    def generate(self, prompts, params, seeds=None):
        from a2tgpo.rollout.engine import Generation

        self.batches.append(len(prompts))
        self.longest = max([self.longest, *map(len, prompts)])
        if self.error is not None and any("boom" in self.tok.decode(p) for p in prompts):
            raise self.error
        return [Generation(self.ids, (0.0,) * len(self.ids), "stop", "</answer>")
                for _ in prompts]


def _predict(toy_cell, tmp_path, engine_error=None, questions=("Who is Foo?", LONG, "boom?",
                                                               "Where is Foo?"), other="Who?"):
    from a2tgpo.eval.evaluate import predict
    from a2tgpo.model.backbone import load_tokenizer
    from a2tgpo.rollout.agent import SearchTool

    cfg = toy_cell.cfg
    tok = load_tokenizer(cfg.backbone)
    a = _write_parquet(tmp_path / "a.parquet", [
        {"id": f"a{i}", "group": "multi_hop", "question": q, "golden_answers": ["Foo"]}
        for i, q in enumerate(questions)])
    b = _write_parquet(tmp_path / "b.parquet", [{"id": "b0", "group": "single_hop",
                                                 "question": other, "golden_answers": ["Bar"]}])
    sets = load_test_sets([a, b])
    engine = AnswerEngine(tok, engine_error)
    tool = SearchTool(None, tok, cfg.rollout, cfg.retrieval)  # nobody searches
    return cfg, tok, sets, engine, predict(cfg, tok, engine, tool, sets, chunk=8,
                                           progress=False)


def test_failed_questions_are_recorded_and_the_others_evaluated(toy_cell, tmp_path, caplog):
    from a2tgpo.train.episodes import prompt_budget, prompt_lengths, question_of

    with caplog.at_level("WARNING", logger="a2tgpo.eval.evaluate"):
        cfg, tok, sets, engine, preds = _predict(
            toy_cell, tmp_path, RuntimeError("CUDA out of memory (simulated)"))
    budget = prompt_budget(cfg)  # backbone.max_model_len 8192 - rollout.max_response_tokens 400
    assert budget == 7792
    (long_len,) = prompt_lengths(cfg, tok, [question_of(sets[0].rows[1])])
    assert long_len > budget and engine.longest <= budget  # the long prompt never ran
    a = preds["a"]
    assert [p["outcome"] for p in a] == ["correct", "prompt_too_long", "error", "correct"]
    assert a[1]["error"] == (f"its prompt is {long_len} tokens, over the prompt budget of 7792 "
                             "(backbone.max_model_len 8192 - rollout.max_response_tokens 400)")
    assert a[2]["error"] == "RuntimeError: CUDA out of memory (simulated)"
    for p in a[1:3]:
        assert (p["prediction"], p["em"], p["f1"], p["tool_calls"], p["stop"]) == (
            None, 0.0, 0.0, 0, None)
    assert [p["prediction"] for p in (a[0], a[3], *preds["b"])] == ["Foo"] * 3
    assert [p["error"] for p in (a[0], a[3], *preds["b"])] == [None] * 3
    # 4 rows go to the engine (a0, a2, a3, b0) and raise; halves [a0, a2] (raises) and
    # [a3, b0]; [a0, a2] splits into [a0] and [a2], which raises alone
    assert engine.batches == [4, 2, 1, 1, 2]
    logged = caplog.text
    assert "a.parquet: row 1 (id 'a1') not evaluated (prompt_too_long)" in logged
    assert "a.parquet: row 2 (id 'a2') not evaluated (error): RuntimeError" in logged

    summary = write_results(tmp_path / "eval", sets, preds, step=0, checkpoint="c",
                            criterion=None, label="step 0")
    # failed rows count as wrong: a has EM (1 + 0 + 0 + 1)/4 = 0.5; b 0/1 ("Foo" vs "Bar")
    assert summary["failed"] == 2
    assert summary["datasets"]["a"] == {"n": 4, "em": 0.5, "f1": 0.5, "group": "multi_hop",
                                        "failed": 2}
    assert summary["datasets"]["b"]["failed"] == 0
    rec = json.loads((tmp_path / "eval" / "a.json").read_text())
    assert rec["failed"] == 2
    assert rec["outcomes"] == pytest.approx({
        "correct": 0.5, "limit": 0.0, "format": 0.0, "not_copied": 0.0, "stopped_early": 0.0,
        "query_missed": 0.0, "prompt_too_long": 0.25, "error": 0.25})


@pytest.mark.parametrize("fatal", ["stop", "engine", "retriever"])
def test_a_stop_or_a_dead_engine_still_ends_the_evaluation(toy_cell, tmp_path, fatal):
    from a2tgpo.ops.preemption import StopRequested
    from a2tgpo.retrieval.http import RetrieverUnavailable
    from a2tgpo.rollout.vllm_engine import EngineDead

    error = {"stop": StopRequested("stop requested (SIGTERM)"), "engine": EngineDead("gone"),
             "retriever": RetrieverUnavailable("no answer")}[fatal]
    with pytest.raises(type(error)):
        _predict(toy_cell, tmp_path, error)


def test_an_evaluation_where_every_question_raises_fails(toy_cell, tmp_path):
    with pytest.raises(RuntimeError, match=r"every question's rollout raised \(2; the first, "
                                           r"'a0': ValueError: bad\)"):
        _predict(toy_cell, tmp_path, ValueError("bad"), questions=("boom?",), other="boom!")


def test_a_100k_character_question_does_not_take_the_evaluation_down(toy_cell, own_cell,
                                                                     capsys):
    # the real policy and engine: the long question is recorded, the other one answered
    from a2tgpo.cli import main
    from a2tgpo.data.qa import load_split

    cell, _ = own_cell
    first = load_split(toy_cell.tests["ts"])[0]
    path = _write_parquet(cell / "long.parquet", [
        {**first, "id": "ok"}, {"id": "long", "group": first["group"], "question": LONG}])
    (cell / "best.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM", "step": 2,
        "checkpoint": "checkpoints/step_000002/model", "value": 0.5, "candidates": {"2": 0.5}}))
    out = cell / "eval"
    assert main(["evaluate", str(cell / "config.yaml"), "--best", str(cell / "best.json"),
                 "--test", str(path), "--out", str(out)]) == 0
    assert "2 questions (1 not evaluated: " in capsys.readouterr().out
    ok, long = read_jsonl(out / "long.predictions.jsonl")
    # the policy was fitted to answer the first question's gold after one search
    assert (ok["prediction"], ok["em"], ok["tool_calls"]) == (toy_cell.answer, 1.0, 1)
    assert (long["outcome"], long["prediction"]) == ("prompt_too_long", None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"] == 1 and summary["datasets"]["long"]["em"] == 0.5


# --------------------------------------------------------------------------------------------
# end to end


@pytest.mark.slow
def test_evaluate_best_end_to_end(toy_cell, own_cell, capsys):
    from a2tgpo.algo.rewards import exact_match, f1_score
    from a2tgpo.cli import main
    from a2tgpo.data.qa import load_split

    answer, tests = toy_cell.answer, toy_cell.tests
    cell, _ = own_cell
    (cell / "best.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM", "step": 2,
        "checkpoint": "checkpoints/step_000002/model", "value": 0.5,
        "candidates": {"0": 0.5, "2": 0.5}}))
    out = cell / "eval"
    rc = main(["evaluate", str(cell / "config.yaml"), "--best", str(cell / "best.json"),
               "--test", str(tests["ts"]), str(tests["tm"]), "--out", str(out),
               "--max-batch", "4", "--chunk", "5"])  # several chunks and forward batches
    assert rc == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("step 2 (dev EM): EM ") and str(out) in line

    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 2 and summary["criterion"] == "dev_em"
    assert summary["checkpoint"] == "checkpoints/step_000002/model"
    total_em, total_n, hits = 0.0, 0, 0
    for name, (group, n) in toy_cell.sets.items():
        rows = load_split(tests[name])
        preds = read_jsonl(out / f"{name}.predictions.jsonl")
        assert len(preds) == n == len(rows)
        assert [p["id"] for p in preds] == [r["id"] for r in rows]
        for p, r in zip(preds, rows, strict=True):
            # the model was fitted to one script: it searched once and answered `answer`
            assert p["prediction"] == answer and p["queries"] == [toy_cell.query]
            assert p["tool_calls"] == 1 and p["stop"] == "answer"
            # an answer turn after one search: correct exactly when EM; otherwise a format
            # failure exactly when the format check failed (the training reward's -1), else
            # a reading or search failure; never a limit
            assert (p["outcome"] == "correct") == (p["em"] == 1.0)
            if p["em"] < 1.0:
                assert (p["outcome"] == "format") == (not p["format_ok"])
            assert p["outcome"] != "limit"
            # EM/F1 recomputed from the prediction by the reward module
            assert p["em"] == exact_match(p["prediction"], r["golden_answers"])
            assert p["f1"] == pytest.approx(f1_score(p["prediction"], r["golden_answers"]))
            hits += p["em"] == 1.0
        rec = json.loads((out / f"{name}.json").read_text())
        assert rec["group"] == group and rec["n"] == n and rec["step"] == 2
        assert rec["em"] == pytest.approx(sum(p["em"] for p in preds) / n)
        assert rec["f1"] == pytest.approx(sum(p["f1"] for p in preds) / n)
        assert rec["format_ok"] == pytest.approx(sum(p["format_ok"] for p in preds) / n)
        assert rec["tool_calls"] == 1.0
        assert rec["outcomes"]["correct"] == pytest.approx(rec["em"])
        assert rec["outcomes"]["query_missed"] == pytest.approx(
            sum(p["outcome"] == "query_missed" for p in preds) / n)
        assert summary["datasets"][name] == pytest.approx(
            {"n": n, "em": rec["em"], "f1": rec["f1"], "group": group, "failed": 0})
        assert summary["groups"][group]["em"] == pytest.approx(rec["em"])  # one set per group
        total_em += rec["em"] * n
        total_n += n
    # the answer is the first question's gold, so at least that question is right
    assert hits >= 1
    assert summary["groups"]["all"]["n"] == total_n == 8
    assert summary["groups"]["all"]["em"] == pytest.approx(total_em / total_n)
    assert math.isclose(summary["groups"]["all"]["em"], hits / 8)
    # tracking went to <out>/tracking (the cell's summary.json and metrics.jsonl untouched)
    logged = read_jsonl(out / "tracking" / "metrics.jsonl")
    assert logged[0]["step"] == 2
    assert logged[0]["test/all/em"] == pytest.approx(summary["groups"]["all"]["em"])
    assert logged[0]["test/ts/em"] == pytest.approx(summary["datasets"]["ts"]["em"])
    assert not (cell / "metrics.jsonl").exists()


@pytest.mark.slow
def test_all_checkpoints_then_test_avg_selection(toy_cell, own_cell):
    from a2tgpo.cli import main

    cell, _ = own_cell
    tests = [str(toy_cell.tests["ts"]), str(toy_cell.tests["tm"])]
    cmd = ["evaluate", str(cell / "config.yaml"), "--all-checkpoints", "--test", *tests,
           "--out", str(cell / "eval_all")]
    assert main(cmd) == 0
    s0, s2 = (json.loads((cell / "eval_all" / f"step_{s:06d}" / "summary.json").read_text())
              for s in (0, 2))
    assert (s0["step"], s0["criterion"], s0["label"]) == (0, None, "step 0")
    assert s2["checkpoint"] == "checkpoints/step_000002/model"
    # both checkpoints hold the same weights: greedy evaluation gives the same numbers
    assert s0["groups"] == s2["groups"] and s0["datasets"] == s2["datasets"]
    logged = read_jsonl(cell / "eval_all" / "tracking" / "metrics.jsonl")
    assert [r["step"] for r in logged] == [0, 2]
    assert logged[1]["test_by_checkpoint/all/em"] == pytest.approx(s2["groups"]["all"]["em"])

    # the trained checkpoint is selected (step 0, the starting policy, is no candidate when
    # a later checkpoint exists)
    assert main(["select", str(cell), "--criterion", "test_avg"]) == 0
    best = json.loads((cell / "best.json").read_text())
    assert (best["step"], best["criterion"]) == (2, "test_avg")
    assert best["value"] == s2["groups"]["all"]["em"]
    assert best["candidates"] == {"2": best["value"]}

    # a rerun keeps finished steps instead of evaluating them again
    stamp = (cell / "eval_all" / "step_000002" / "summary.json").stat().st_mtime_ns
    assert main(cmd) == 0
    assert (cell / "eval_all" / "step_000002" / "summary.json").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_broken_tracking_does_not_fail_evaluation(toy_cell, own_cell, caplog):
    from a2tgpo.eval.evaluate import evaluate_best

    cell, cfg = own_cell
    (cell / "mlflow_run.json").write_text("{}")  # a link without its keys: attach raises
    (cell / "best.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM", "step": 0,
        "checkpoint": "checkpoints/step_000000/model", "value": 0.0, "candidates": {"0": 0.0}}))
    summary, line = evaluate_best(cfg, cell / "best.json", [toy_cell.tests["tm"]], cell / "eval",
                                  progress=False)
    assert json.loads((cell / "eval" / "summary.json").read_text()) == summary
    assert summary["groups"]["all"]["n"] == 3 and "3 questions" in line
    assert any("tracking the evaluation" in r.getMessage() and "KeyError" in r.getMessage()
               for r in caplog.records)


def test_eval_engine_share_reaches_the_engine_config(toy_cell, own_cell, monkeypatch):
    # the arguments eval.smk puts after the cell config (eval.engine_memory_share, eval.chunk)
    import dataclasses

    from a2tgpo.cli import main
    from a2tgpo.config import load_config
    from a2tgpo.eval import evaluate
    from a2tgpo.train.config import TrainConfig

    cell, cfg = own_cell
    assert load_config(TrainConfig, cell / "config.yaml").engine_memory_share == 0.6
    built = []

    class Built(Exception):
        pass

    def make_engine(cfg, model, tok, devices=None):
        built.append(cfg)
        raise Built  # the config is what this test needs; no rollouts

    monkeypatch.setattr(evaluate, "make_engine", make_engine)
    (cell / "best.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM", "step": 2,
        "checkpoint": "checkpoints/step_000002/model", "value": 0.5, "candidates": {"2": 0.5}}))
    with pytest.raises(Built):
        main(["evaluate", str(cell / "config.yaml"), "engine_memory_share=0.85", "--chunk", "256",
              "--best", str(cell / "best.json"), "--test", str(toy_cell.tests["ts"]),
              "--out", str(cell / "eval")])
    (engine_cfg,) = built
    assert engine_cfg.engine_memory_share == 0.85
    # nothing else changed: the backbone is the selected checkpoint, as without the override
    assert engine_cfg.backbone.path == str(cell / "checkpoints/step_000002/model")
    assert dataclasses.replace(engine_cfg, engine_memory_share=0.6,
                               backbone=cfg.backbone) == cfg


def test_missing_best_json_is_a_clear_cli_error(toy_cell, own_cell, capsys):
    from a2tgpo.cli import main

    cell, _ = own_cell
    rc = main(["evaluate", str(cell / "config.yaml"), "--best", str(cell / "best.json"),
               "--test", str(toy_cell.tests["ts"]), "--out", str(cell / "eval")])
    assert rc == 1
    assert f"{cell / 'best.json'}: no such selection file" in capsys.readouterr().err
    assert not (cell / "eval").exists()


@pytest.mark.slow
def test_metrics_go_to_the_cells_mlflow_run(toy_cell, own_cell, tmp_path, monkeypatch):
    """The test metrics go to the cell's run, and the evaluation runs inside its Tracker: the
    run is RUNNING while the test sets are evaluated, mlflow's system metrics cover that, the
    job's peak memory is logged at its end, and an evaluation that fails ends the run FAILED
    and raises."""
    import dataclasses

    from mlflow import MlflowClient

    import a2tgpo.eval.evaluate as ev
    from a2tgpo.eval.evaluate import evaluate_best
    from a2tgpo.tracking import Tracker, TrackingConfig, resolve_tracking_uri

    cell, cfg = own_cell
    results = tmp_path / "results"
    cfg = dataclasses.replace(cfg, results_dir=str(results),
                              tracking=TrackingConfig(system_metrics_interval_s=0.2))
    train_tracking = dataclasses.replace(cfg.tracking, system_metrics=False)
    with Tracker(cell, train_tracking, study="toy", run_name="cell", results_dir=results) as train:
        train.log({"val/em": 0.5}, 0)  # what training leaves: the run and mlflow_run.json
    (cell / "best.json").write_text(json.dumps({
        "criterion": "dev_em", "label": "dev EM", "step": 0,
        "checkpoint": "checkpoints/step_000000/model", "value": 0.5, "candidates": {"0": 0.5}}))
    client = MlflowClient(tracking_uri=resolve_tracking_uri(cfg.tracking, results))
    status, real = [], ev.evaluate_checkpoint

    def observed(*args, **kwargs):
        status.append(client.get_run(train.run_id).info.status)
        return real(*args, **kwargs)

    monkeypatch.setattr(ev, "evaluate_checkpoint", observed)
    summary, _ = evaluate_best(cfg, cell / "best.json", [toy_cell.tests["ts"]], cell / "eval",
                               progress=False)
    assert status == ["RUNNING"]  # the run was open while the test set was evaluated
    cpu = client.get_metric_history(train.run_id, "system/cpu_utilization_percentage")
    assert cpu and [p.step for p in cpu] == list(range(len(cpu)))
    peak = json.loads((cell / "eval" / ev.TRACKING_SUBDIR / "summary.json").read_text())
    run = client.get_run(train.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["eval.checkpoint"] == "checkpoints/step_000000/model"
    assert run.data.tags["eval.criterion"] == "dev_em"
    m = run.data.metrics
    assert m["test/ts/em"] == pytest.approx(summary["datasets"]["ts"]["em"])
    assert m["test/single_hop/f1"] == pytest.approx(summary["groups"]["single_hop"]["f1"])
    assert m["test/all/em"] == pytest.approx(summary["groups"]["all"]["em"])
    assert m["eval/questions"] == 5 and m["val/em"] == 0.5
    assert [h.step for h in client.get_metric_history(train.run_id, "test/all/em")] == [0]
    assert peak["peak_memory/eval/host_gib"] > 0
    assert m["peak_memory/eval/host_gib"] == pytest.approx(peak["peak_memory/eval/host_gib"])
    assert "peak_memory/eval/host_children_gib" in m

    def broken(*args, **kwargs):
        raise RuntimeError("the engine died")

    monkeypatch.setattr(ev, "evaluate_checkpoint", broken)
    with pytest.raises(RuntimeError, match="the engine died"):
        evaluate_best(cfg, cell / "best.json", [toy_cell.tests["ts"]], cell / "eval",
                      progress=False)
    assert client.get_run(train.run_id).info.status == "FAILED"
