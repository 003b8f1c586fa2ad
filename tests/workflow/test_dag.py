"""The Snakemake DAG: dry runs, config validation before any job, and the toy stages for real."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


def smk(workdir, *args, timeout=600):
    # rules call the `a2tgpo` console script of this environment
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run([SNAKEMAKE, *args], cwd=workdir, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_dry_run_default_config(workdir):
    r = smk(workdir, "-n", "--quiet", "rules")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    for rule in ("world", "prepare_track_data", "resolve_section", "train", "all"):
        assert rule in out
    assert "download_corpus" not in out  # the toy corpus comes from the world
    # the study starts from the shipped reader: nothing builds or warm-starts a backbone
    assert "toy_backbone" not in out and "\nsft " not in out


def test_dry_run_built_backbone_plans_its_build_and_warm_start(workdir):
    r = smk(workdir, "-n", "--quiet", "rules", "--config", "backbones=['toy_reader', 'toy']")
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    assert "toy_backbone" in out and "\nsft " in out


def test_the_warm_start_reads_the_studys_retrieval_section(workdir):
    r = smk(workdir, "-n", "--printshellcmds", "results/toy/sft/config.json", "--config",
            "backbones=['toy_reader', 'toy']")
    assert r.returncode == 0, r.stderr[-3000:]
    (cmd,) = re.findall(r"^Shell command: (a2tgpo sft .*)$", r.stdout, re.M)
    assert "--retrieval results/toy/configs/retrieval.yaml " in cmd, cmd


def test_dry_run_hub_corpus_plans_download(workdir):
    r = smk(workdir, "-n", "--quiet", "rules", "--config", "corpus={'source': 'hub'}")
    assert r.returncode == 0, r.stderr
    assert "download_corpus" in r.stdout + r.stderr


@pytest.mark.parametrize("override, needle", [
    ("world={'peeple': 3}", "world.peeple: unknown key (did you mean 'people'?)"),
    ("world={'people': 'many'}", "world.people: expected int, got 'many'"),
    ("backbones=['nope']", "backbones[0]: no backbone file"),  # cross-file check
    # a nested --config value (Snakemake reads it as the string '0'), out of range
    ("train={'schedule': {'save_every': 0}}",
     "train.schedule.save_every: 0 is out of range: must be >= 1"),
    # check_study, which `a2tgpo check-config` runs too
    ("train={'method_overrides': {'a2tgop': ['method.rollout.n=4']}}",
     "train.method_overrides.a2tgop: matches no method id"),
])
def test_invalid_config_fails_before_any_job(workdir, override, needle):
    r = smk(workdir, "-n", "--config", override)
    assert r.returncode != 0
    out = r.stdout + r.stderr
    # our message first, naming the config's files, not the JSON schema's dump
    assert f"invalid config: config (config/config.yaml + --config {override}): " in out, out
    assert needle in out
    assert "Failed validating" not in out and "additionalProperties" not in out
    assert not (workdir / "results").exists()


def test_a_duplicate_key_in_a_config_file_fails_before_any_job(workdir):
    # Snakemake's own YAML loader keeps the last block: this one would reset the study's
    # retrieval section to its defaults (and re-encode the index)
    cfg = workdir / "config/config.yaml"
    lines = cfg.read_text().splitlines()
    first = lines.index("retrieval:") + 1
    cfg.write_text("\n".join(lines + ["retrieval:", "  topk: 3"]) + "\n")
    r = smk(workdir, "-n")
    assert r.returncode != 0
    assert (f"invalid config: config/config.yaml: line {len(lines) + 1}: retrieval: duplicate "
            f"key (first set at line {first};") in r.stdout + r.stderr, r.stderr
    assert not (workdir / "results").exists()


def test_nested_config_values_reach_the_study_typed(workdir):
    # the README's example: the lr given inside a mapping value on the command line
    r = smk(workdir, "-n", "--config", "train={'optim': {'lr': 3e-4}, 'schedule': {'steps': 5}}",
            "--quiet", "rules")
    assert r.returncode == 0, r.stderr[-3000:]


def test_every_shell_command_quotes_its_paths(workdir):
    """A results folder whose name holds a space and a command substitution: in a dry run
    (--printshellcmds), every shell command Snakemake would run keeps each path one word, so
    nothing is split and nothing substituted. The targets reach every rule with a shell
    command but the hub fetches and the corpus download."""
    import shlex

    results = workdir / "my results $(touch PWNED)"
    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["results_dir"] = str(results)
    for source in cfg["data"]["train"] + cfg["data"]["test"]:  # the toy world's QA folder
        source["repo"] = source["repo"].replace("results/", f"{results}/", 1)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    r = smk(workdir, "-n", "--printshellcmds", "all", "sweep_toy", "beta", "--config",
            "train={'selection': 'test_avg'}", "backbones=['toy_reader', 'toy']",
            "retrieval={'mode': 'http', 'http': {'serve': 'job'}}")
    assert r.returncode == 0, r.stderr[-3000:]
    commands = {}
    for block in r.stdout.split("\n\n"):
        rule = re.search(r"^rule (\w+):", block, re.M)
        shell = re.search(r"^Shell command: (.*)$", block, re.M)
        if rule and shell and shell.group(1) != "None":  # None: a run: rule
            commands.setdefault(rule.group(1), []).append(shell.group(1))
    assert set(commands) == {
        "world", "toy_backbone", "prepare_data", "prepare_track_data", "encode_shard",
        "build_index", "check_index", "retrieval_eval", "sft", "train", "evaluate_all",
        "select", "evaluate", "tables", "plots", "set_tables", "set_plots", "sweep_trial",
        "sweep_summary"}, sorted(commands)
    for rule, cmds in commands.items():
        for cmd in cmds:
            # as the shell splits it: a word that starts the results path holds all of it
            words = [w for w in shlex.split(cmd) if str(workdir / "my") in w]
            assert words, (rule, cmd)
            assert all(w.startswith(str(results)) for w in words), (rule, cmd)
    # a job's own retrieval server (a command prefix built in common.smk) quotes its paths too
    for rule in ("train", "sweep_trial", "evaluate"):
        assert all(f"with-retriever '{results}/" in c for c in commands[rule]), rule


def small_toy(workdir, methods=("react", "grpo", "a2tgpo")):
    """The toy study shrunk to seconds per stage: a small world, the built backbone (`toy`:
    tokenizer, model and SFT stages, which the default study's shipped reader skips) with one
    SFT epoch, one track, a 3-cell grid of 2 training steps. The DAG is the same one
    `snakemake` runs."""
    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["backbones"] = ["toy"]
    cfg.pop("tracks")
    cfg["sweeps"] = []  # the study's sweep starts from the reader
    cfg["world"].update(people=40, films=20, companies=10, bands=8, cities=12, distractors=10)
    cfg["world"]["qa_sets"] = [
        {"name": "toy_nq", "group": "single_hop", "splits": {"train": 30, "test": 10},
         "mix": {"single": 1.0}},
        {"name": "toy_hotpotqa", "group": "multi_hop", "splits": {"train": 30, "dev": 10},
         "mix": {"bridge": 0.8, "comparison": 0.2}},
    ]
    cfg["data"]["dev_size"] = 6
    cfg["sft"] = {"epochs": 1, "max_questions": 12, "datasets": ["toy_nq/train"]}
    cfg["data"]["test"] = [t for t in cfg["data"]["test"]
                           if t["name"] in ("toy_nq", "toy_hotpotqa")]
    cfg["grid"] = {"default": ["mini"], "sets": {
        "mini": {"methods": list(methods), "seeds": [1]},
        "beta": {"methods": ["a2tgpo"], "betas": [0.3, 0.5], "seeds": [1]}}}
    cfg["train"]["schedule"].update(steps=2, prompts_per_step=2, mini_batch_prompts=1,
                                    eval_every=2, save_every=2, eval_questions=4)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


CELLS = [f"backbone~toy/method~{m}/beta~{b}/seed~1"
         for m, b in (("react", "0"), ("grpo", "0"), ("a2tgpo", "0.3"))]


@pytest.mark.expensive  # ~2 minutes: CI runs it in its own step (.ci/run)
def test_toy_dag_end_to_end(workdir):
    small_toy(workdir)
    r = smk(workdir)
    assert r.returncode == 0, r.stderr[-3000:]
    res = workdir / "results/toy"
    data = json.loads((res / "data/summary.json").read_text())
    assert data["files"]["dev.parquet"]["rows"] == 6
    assert (res / "backbone/model.safetensors").exists()
    assert (res / "sft/model.safetensors").exists()
    assert json.loads((res / "retrieval/recall.json").read_text())["dense"]["n"] > 0

    # every cell trained (2 steps; ReAct evaluates its starting policy), selected, evaluated
    for cell in CELLS:
        run = res / "runs" / cell
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == 2
        best = json.loads((run / "best.json").read_text())
        assert best["criterion"] == "dev_em" and (run / best["checkpoint"]).is_dir()
        ev = json.loads((run / "eval/summary.json").read_text())
        # 10 toy_nq test + 10 toy_hotpotqa dev questions (the papers' test-or-dev rule)
        assert {k: v["n"] for k, v in ev["datasets"].items()} == {"toy_nq": 10,
                                                                   "toy_hotpotqa": 10}
    main = (res / "tables/main.md").read_text()
    for label in ("ReAct", "GRPO", "A2TGPO"):
        assert label in main
    assert json.loads((res / "plots/index.json").read_text())["plots"]

    # MLflow: one run per cell, holding training and evaluation metrics
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{res.resolve() / 'mlflow.db'}")
    exp = client.get_experiment_by_name("toy")
    everything = client.search_runs([exp.experiment_id])
    # the study's own run (tables and plots, tag kind=study) beside one run per cell
    [study_run] = [r for r in everything if r.data.tags.get("kind") == "study"]
    assert "tables/main.md" in {a.path for a in client.list_artifacts(
        study_run.info.run_id, "tables")}
    runs = [r for r in everything if r.data.tags.get("kind") != "study"]
    assert sorted(r.data.tags["cell"] for r in runs) == sorted(CELLS)
    for run in runs:
        assert run.info.status == "FINISHED"
        assert "test/toy_nq/em" in run.data.metrics and "val/em" in run.data.metrics
        # the machine while the jobs ran, and each job's peak memory at its end
        assert "system/cpu_utilization_percentage" in run.data.metrics
        assert {"peak_memory/train/host_gib", "peak_memory/eval/host_gib"} <= set(run.data.metrics)
        if run.data.tags["method"] != "react":
            assert "train/reward" in run.data.metrics

    # the job logs read as a person reads them (a2tgpo/ops/joblog.py): plain lines, no bar
    # frames and no loader noise; each begins with what the job is and ends with how it went
    logs = sorted(p for p in (res / "logs").rglob("*.log"))
    assert len(logs) > 10
    for path in logs:
        text = path.read_bytes().decode()  # read_text() would turn each \r into \n
        for noise in ("\r", "faiss.loader", "No module named 'faiss", "Setting accelerator"):
            assert noise not in text, (path, noise, text[-2000:])
        if path.name == "mlflow_experiment.log":  # a Snakemake `run:` block's one line
            continue
        job = [ln.split("a2tgpo.job: ", 1)[1] for ln in text.splitlines() if "a2tgpo.job: " in ln]
        assert job[0].startswith("a2tgpo ") and job[1].startswith("command: a2tgpo "), path
        assert job[-1].startswith("a2tgpo ") and " finished in " in job[-1], path
    train = (res / "logs/runs" / CELLS[2] / "train.log").read_text()
    job = [ln.split("a2tgpo.job: ", 1)[1] for ln in train.splitlines() if "a2tgpo.job: " in ln]
    assert job[0] == f"a2tgpo train · cell {CELLS[2]}" and len(job) == 5  # 4 + closing line
    assert job[-1].startswith("a2tgpo train finished in ") and "2 steps; best dev EM" in job[-1]
    # a line per step: step, reward, EM, seconds, ETA
    steps = [ln.split("rl: ")[1] for ln in train.splitlines() if ": reward " in ln]
    assert [ln.split(":")[0] for ln in steps] == ["step 1/2", "step 2/2"]
    assert all(" EM " in ln and " s, ETA " in ln for ln in steps)

    # nothing changed -> nothing to do
    r = smk(workdir, "-n")
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr

    # the Snakemake report collects the tables and plots with their captions
    r = smk(workdir, "--report", "report.zip")
    assert r.returncode == 0, r.stderr[-3000:]
    import zipfile

    names = zipfile.ZipFile(workdir / "report.zip").namelist()
    assert any(n.endswith("main.md") for n in names)
    assert any(n.endswith("dev_em.png") for n in names)

    # rerunning one cell retrains and re-evaluates it alone, then refreshes the tables
    before = {c: (res / "runs" / c / "summary.json").stat().st_mtime_ns for c in CELLS}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run([str(Path(sys.executable).parent / "a2tgpo"), "rerun", "method=grpo",
                        "--", "--cores", "2"], cwd=workdir, capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    after = {c: (res / "runs" / c / "summary.json").stat().st_mtime_ns for c in CELLS}
    assert [c for c in CELLS if after[c] != before[c]] == [CELLS[1]]
    assert list((res / "archive" / CELLS[1]).iterdir())  # the old run is kept, not deleted
    assert (res / "tables/main.md").stat().st_mtime_ns > before[CELLS[1]]

    # a changed world section reruns the world and everything downstream of it (a
    # --configfile stands alone, so the edited study is a full copy)
    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["world"]["seed"] = 1
    (workdir / "seed1.yaml").write_text(yaml.safe_dump(cfg))
    r = smk(workdir, "-n", "--quiet", "rules", "--configfile", "seed1.yaml")
    assert r.returncode == 0, r.stderr
    for rule in ("world", "prepare_data", "train", "evaluate", "tables"):
        assert rule in r.stdout


@pytest.mark.expensive
def test_killed_snakemake_leaves_one_writer_per_run_folder(workdir):
    # Snakemake killed mid-training (SIGKILL: no chance to clean up): its training job must not
    # run on unseen (it checkpoints and exits), and the rerun after --unlock resumes the cell
    # with one writer: every step trained and logged once
    import signal
    import time

    from a2tgpo.ops.lock import holder
    from a2tgpo.tracking import read_metrics

    small_toy(workdir, methods=("grpo",))
    cfg = yaml.safe_load((workdir / "config/config.yaml").read_text())
    cfg["train"]["schedule"].update(steps=8, eval_every=4, save_every=4)
    (workdir / "config/config.yaml").write_text(yaml.safe_dump(cfg))
    run = workdir / "results/toy/runs/backbone~toy/method~grpo/beta~0/seed~1"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    first = subprocess.Popen([SNAKEMAKE, "--cores", "2"], cwd=workdir, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        while not ((run / "metrics.jsonl").exists()
                   and any(r["step"] >= 2 for r in read_metrics(run))):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        job = holder(run)["pid"]
        first.send_signal(signal.SIGKILL)
        first.wait()
        t0 = time.monotonic()
        while Path(f"/proc/{job}").exists() and time.monotonic() - t0 < 120:
            time.sleep(0.2)
        assert not Path(f"/proc/{job}").exists(), "the training job outlived its Snakemake"
        print(f"the orphaned training job ended {time.monotonic() - t0:.1f} s after the kill")
    finally:
        first.kill()
    log = (workdir / "results/toy/logs/runs" / run.relative_to(workdir / "results/toy/runs")
           / "train.log").read_text()
    assert "has ended: sending SIGTERM" in log and "exit 75 (resumable)" in log
    assert smk(workdir, "--unlock").returncode == 0
    r = smk(workdir, "--cores", "2", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    trained = [row["step"] for row in read_metrics(run) if "train/reward" in row]
    assert trained == list(range(1, 9))


@pytest.mark.expensive
def test_a_dead_tracking_server_does_not_stop_the_dag(workdir):
    # the experiment-creation rule, which every training job waits for, succeeds anyway
    import socket

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = smk(workdir, "results/toy/mlflow/experiment.json", "--cores", "1", "--config",
            f"tracking={{'tracking_uri': 'http://127.0.0.1:{port}'}}")
    assert r.returncode == 0, r.stderr[-3000:]
    record = json.loads((workdir / "results/toy/mlflow/experiment.json").read_text())
    assert record["created"] is False and "unreachable" in record["error"]


def test_dry_run_papers_selection_evaluates_every_checkpoint(workdir):
    r = smk(workdir, "-n", "--quiet", "rules", "--config", "train={'selection': 'test_avg'}")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "evaluate_all" in out
    # the default selection (dev EM) plans no test-set evaluation of every checkpoint
    r = smk(workdir, "-n", "--quiet", "rules")
    assert "evaluate_all" not in r.stdout


def test_dry_run_paper_grid(workdir):
    r = smk(workdir, "-n", "--quiet", "rules", "--configfile", "config/paper.yaml")
    assert r.returncode == 0, r.stderr
    counts = {}
    for line in r.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    # 3 backbones x 2 tracks x 10 main methods = 60, Tree-GRPO on Qwen2.5-7B x 2 tracks = 2,
    # ablation cells on Qwen3-4B: 15 methods x 2 tracks = 30, of which igpo, a2tgpo,
    # a2tgpo_release and at2po (8 cells) are already main cells -> 60 + 2 + 22 = 84
    assert counts["train"] == counts["evaluate"] == counts["cell_config"] == 84
    assert counts["prepare_track_data"] == 2 and counts["download_corpus"] == 1


def test_dry_run_paper_jobs_request_the_memory_their_plan_derives(workdir):
    """config/paper.yaml leaves train.mem_mb and eval.mem_mb null: each job requests its own
    plan's host memory x 1.25, per cell and per backbone."""
    from a2tgpo.plan import MIB, plan_evals, plan_study
    from a2tgpo.study import load_study

    cell = "backbone~qwen3-8b/data~multi_hop/method~grpo/beta~0/seed~1"
    # the target first: --configfile takes every argument after it
    r = smk(workdir, f"results/paper/runs/{cell}/eval/summary.json", "-n", "-p",
            "--configfile", "config/paper.yaml")
    assert r.returncode == 0, r.stderr
    study = load_study(str(workdir / "config/paper.yaml"))
    plan = next(p for p in plan_study(study) if p.cell == cell)
    ev = next(e for e in plan_evals(study) if e.backbone == "qwen3-8b")
    jobs = {}
    for block in r.stdout.split("\n\n"):
        rule = re.search(r"^rule (\w+):", block, re.M)
        mem = re.search(r"mem_mb=(\d+)", block)
        if rule and mem:
            jobs[rule.group(1)] = int(mem.group(1))
    # the 8B grpo cell's node: 16 processes x 3 GiB + 8 ranks x 16.4 GB of bf16 weights + the
    # server reading the 64.6 GB index (+ its 3 GiB): 234 GiB, x 1.25 -> ~292 GiB
    assert jobs["train"] == round(plan.mem_request / MIB) > 280 * 1024
    assert jobs["evaluate"] == round(ev.mem_request / MIB) > 100 * 1024
