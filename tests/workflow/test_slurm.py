"""profiles/slurm: its resource mapping in a dry run, and a real SLURM cluster running the toy grid.

The dry-run test (seconds, no SLURM needed) checks what each job of config/paper.yaml asks for.
The cluster test:

tests/workflow/slurm/cluster.sh starts a private single-node cluster on localhost (its own munged,
slurmctld and slurmd, 8 fake GPUs in gres.conf). The toy study shrunk by tests/workflow/slurm/
toy_config.yaml (two grpo cells, tiny world) then runs with the command the README gives
(`snakemake --profile slurm`). While it runs, the training job of one cell is
requeued (`scontrol requeue`, as a preemption does) and the training job of the other cell is
cancelled (`scancel`). The run must go on with --keep-going: the requeued cell trains again,
is selected and evaluated, the independent retrieval check finishes, and Snakemake reports the
cancelled job's failure and exits non-zero. A plain rerun then completes only what is missing.
Also checked: GPU rules got their GPUs (--gpus, never --ntasks-per-gpu), CPU rules none.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (`bash tests/workflow/slurm/
cluster.sh install`); skipped with the reason otherwise. It takes 4-5 minutes on 2 cores (most
of it the plugin's status polling, whose interval grows by 10 s while no job finishes, and each
job re-reading the workflow).

The time-limit test cuts a running training job's limit to a minute (`scontrol update
TimeLimit`): SLURM then sends the profile's early SIGTERM, the trainer checkpoints and exits 75,
Snakemake's retry resumes the cell, and its final weights equal an uninterrupted run's.

Both are marked `cluster` (and `slow`): left out of the default run, `.ci/run` installs SLURM
and runs them as a step of their own (`./run pytest -m cluster tests/workflow/test_slurm.py`).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml
from run_records import learned_summary

from a2tgpo.tracking import read_metrics
from a2tgpo.train.checkpoint import checkpoint_step, latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent / "slurm"
BIN = Path(sys.executable).parent
SNAKEMAKE = str(BIN / "snakemake")

# What the test builds. The grid's tables and plots need every cell evaluated; recall.json is a
# branch of the DAG that does not depend on training, so it must finish although a training job
# fails.
TARGETS = ["results/toy/tables/main.md", "results/toy/plots",
           "results/toy/retrieval/recall.json"]
CELL = "results/toy/runs/backbone~toy/method~grpo/beta~0/seed~{}"
REQUEUE = ("train", "seed~1")  # rule, and a piece of its wildcards: requeued once while running
CANCEL = ("train", "seed~2")   # cancelled while running: the failure the run must report
# The profile as users run it, plus faster status polling than a real cluster needs (the
# cluster keeps finished jobs in squeue for an hour, so squeue status works with 1 s).
COMMAND = [SNAKEMAKE, *TARGETS, "--profile", "slurm",
           "--slurm-init-seconds-before-status-checks", "1",
           "--seconds-between-status-checks", "1",
           "--jobs", "4", "--latency-wait", "5"]
RUN_TIMEOUT = 900


def _missing_prerequisite():
    if os.geteuid() != 0:
        return "starting slurmctld/slurmd/munged needs root"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol")
               if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): "
                "run `bash tests/workflow/slurm/cluster.sh install` (Debian packages, ~6 s)")
    return None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from local_cluster(tmp_path_factory)


def local_cluster(tmp_path_factory, **knobs):
    """The `cluster` fixture's body; `knobs`: cluster.sh's environment knobs (SLURM_KILL_WAIT=
    ...), for a module that needs a cluster set up differently."""
    reason = _missing_prerequisite()
    if reason:
        if os.environ.get("A2TGPO_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    # not under pytest's tmp dirs: they are mode 0700 and munged runs as user munge
    cdir = Path(tempfile.mkdtemp(prefix="a2tgpo-slurm-"))
    # CI (.ci/run) sets A2TGPO_REQUIRE_SLURM: a cluster that does not start is a failure there
    required = os.environ.get("A2TGPO_REQUIRE_SLURM") == "1"
    r = subprocess.run(["bash", str(HERE / "cluster.sh"), "start", str(cdir)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, **{k: str(v) for k, v in knobs.items()}})
    logs = tmp_path_factory.mktemp("slurm-logs")  # the daemons' logs, kept for a failure
    try:
        if r.returncode != 0:
            (pytest.fail if required else pytest.skip)(
                f"could not start a local SLURM cluster: {r.stderr[-2000:]}")
        # DIR/bin holds an srun that keeps SLURM_CONF (see cluster.sh); jobs inherit PATH
        env = {**os.environ, "SLURM_CONF": str(cdir / "slurm.conf"),
               "PATH": f"{cdir / 'bin'}:{BIN}:{os.environ['PATH']}:/usr/sbin:/sbin",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
        yield env
    finally:
        subprocess.run(["bash", str(HERE / "cluster.sh"), "stop", str(cdir)],
                       capture_output=True, text=True, timeout=60)
        if (cdir / "log").is_dir():
            shutil.copytree(cdir / "log", logs, dirs_exist_ok=True)
        shutil.rmtree(cdir, ignore_errors=True)


@pytest.fixture
def workdir(workdir):
    """The workflow copy (tests/conftest.py) with the root's `slurm` profile link."""
    (workdir / "slurm").symlink_to(os.readlink(ROOT / "slurm"))  # `--profile slurm`
    return workdir


def merge(base, over):
    """Mappings merge key by key, anything else is replaced (as Snakemake merges configs)."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
    return over


@pytest.fixture
def toy_workdir(workdir):
    """The working copy with the small study of slurm/toy_config.yaml as its default study."""
    cfg_file = workdir / "config/config.yaml"
    over = yaml.safe_load((HERE / "toy_config.yaml").read_text())
    cfg = merge(yaml.safe_load(cfg_file.read_text()), over)
    cfg["grid"] = over["grid"]  # its own sets only: the default ones train tracks it lacks
    cfg = {k: v for k, v in cfg.items() if v is not None}  # a top-level null removes the key
    cfg_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return workdir


def jobs(env):
    """Every job the cluster knows (finished ones stay for MinJobAge): id -> (state, comment).
    The plugin writes `rule_<rule>_wildcards_<wildcards>` into each job's comment."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%T|%500k"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = (line.split("|", 2) for line in out.splitlines() if line.strip())
    return {jid.strip(): (state.strip(), comment.strip()) for jid, state, comment in rows}


# states a job ends in (squeue --states): not the passing ones a signalled job shows on
# its way (SIGNALING, COMPLETING, STAGE_OUT), which a poll can catch; "": no longer listed
FINAL_STATES = {"", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "SPECIAL_EXIT"}


def find(table, rule, piece, states=None):
    for jid, (state, comment) in table.items():
        if re.match(rf"rule_{rule}($|_wildcards_)", comment) and piece in comment and (
                states is None or state in states):
            return jid
    return None


def show_job(env, jid):
    out = subprocess.run(["scontrol", "show", "job", "-o", jid], env=env, capture_output=True,
                         text=True, check=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def jsonl_rows(path):
    """The rows of a JSON-lines file as written, duplicates and all."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def assert_each_step_logged_once(run_dir, steps):
    """A stopped and resumed run logged every finished step once, as an uninterrupted one does:
    metrics.jsonl has one training row per step 1..steps, its rows never go back to an earlier
    step (a rerun from a checkpoint older than its last logged step would) and no step's
    validation twice; rollouts.jsonl has each (step, group, index) once. (A validation a stop
    cut short is logged by the resumed run in a row of its own, after the step's training
    row: the same step, not an earlier one.)"""
    rows = jsonl_rows(Path(run_dir) / "metrics.jsonl")
    logged = [r["step"] for r in rows]
    assert logged == sorted(logged), logged
    assert [r["step"] for r in rows if "time/step" in r] == list(range(1, steps + 1)), logged
    validated = [r["step"] for r in rows if "val/em" in r]
    assert len(validated) == len(set(validated)), validated
    sampled = [(r["step"], r["group"], r["index"])
               for r in jsonl_rows(Path(run_dir) / "rollouts.jsonl")]
    assert sampled and len(sampled) == len(set(sampled)), sorted(sampled)
    assert [s for s, _, _ in sampled] == sorted(s for s, _, _ in sampled)


def run_snakemake(workdir, env, log, interventions=None):
    """Run COMMAND; `interventions(table)` is called on each squeue poll while it runs."""
    with open(log, "w") as fh:
        proc = subprocess.Popen(COMMAND, cwd=workdir, env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
        deadline = time.monotonic() + RUN_TIMEOUT
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    proc.send_signal(signal.SIGINT)  # SIGINT makes the plugin scancel its jobs
                    proc.wait(60)
                    pytest.fail(f"snakemake ran over {RUN_TIMEOUT} s:\n{log.read_text()[-4000:]}")
                if interventions is not None:
                    interventions(jobs(env))
                time.sleep(0.25)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, log.read_text()


def dry_run_jobs(workdir, *args, shell=False):
    """`snakemake -n` of the paper study with the given profile arguments: one (rule, threads,
    resources) per job, plus its shell command with `shell` (--cores only lifts the dry run's
    cap of 1 on the threads it prints)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    r = subprocess.run([SNAKEMAKE, "-n", "--cores", "1024", *args,
                        "--configfile", "config/paper.yaml"],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    found = []
    for block in re.split(r"\n(?=rule \w+:\n)", r.stdout):
        m = re.match(r"rule (\w+):\n", block)
        if not m:
            continue
        res = re.search(r"^    resources: (.*)$", block, re.M)
        threads = re.search(r"^    threads: (\d+)$", block, re.M)
        job = (m.group(1), int(threads.group(1)) if threads else 1,
               dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {})
        if shell:
            cmd = re.search(r"^Shell command: (.*)$", block, re.M)
            job += (cmd.group(1) if cmd else "",)
        found.append(job)
    return found


@pytest.mark.expensive  # ~25 s on 2 cores: CI runs it in its expensive step (.ci/run)
def test_profile_resource_mapping_dry_run(workdir):
    train = yaml.safe_load((workdir / "config/paper.yaml").read_text())["train"]
    jobs_ = dry_run_jobs(workdir, "--workflow-profile", "profiles/slurm")
    by_rule = {}
    for rule, threads, res in jobs_:
        by_rule.setdefault(rule, (threads, res))
        assert "tasks" not in res, (rule, res)  # GPU jobs would get --ntasks-per-gpu
        assert "gres" not in res, (rule, res)   # gpu and gres together send both flags
    # grid jobs: GPUs, CPUs (cpus_per_task, as the rule sets it: test_profile_cpus.py), wall
    # time and memory from the study config (train.*)
    threads, res = by_rule["train"]
    assert threads == train["threads"] == int(res["cpus_per_task"]), res
    # SIGTERM 10 min before the time limit: the trainer checkpoints and exits 75
    assert "--signal=TERM@600" in res.get("slurm_extra", ""), res
    assert (int(res["gpu"]), int(res["runtime"])) == (
        train["nproc"] * train["nodes"], train["runtime_min"]), res
    # memory: train.mem_mb and eval.mem_mb are null, so each job requests its plan's host
    # memory x 1.25 (a2tgpo.plan), one value per cell / per backbone
    from a2tgpo.plan import MIB, plan_evals, plan_study
    from a2tgpo.study import load_study

    assert train["mem_mb"] is None
    study = load_study(str(workdir / "config/paper.yaml"))
    mems = lambda rule: {int(r["mem_mb"]) for n, _, r in jobs_ if n == rule}  # noqa: E731
    assert mems("train") == {round(p.mem_request / MIB)
                             for p in plan_study(study, list(study.grid.default))}
    assert mems("evaluate") == {round(e.mem_request / MIB) for e in plan_evals(study)}
    # evaluation jobs: the study config's eval section, not training's resources
    ev = yaml.safe_load((workdir / "config/paper.yaml").read_text())["eval"]
    threads, res = by_rule["evaluate"]
    assert threads == ev["threads"] == int(res["cpus_per_task"]), res
    assert (int(res["gpu"]), int(res["runtime"])) == (ev["gpus"], ev["runtime_min"]), res
    assert ev["runtime_min"] != train["runtime_min"]
    # CPU jobs: no GPU, the profile's CPUs and memory
    assert "gpu" not in by_rule["prepare_track_data"][1], by_rule["prepare_track_data"]
    assert by_rule["prepare_track_data"][1]["cpus_per_task"] == "4"
    assert by_rule["download_corpus"][1]["runtime"] == "720"

    # the commands the README gives: --profile slurm (the root link) and the folder's path;
    # profiles/default, applied on top as the workflow profile, must not change any request
    for profile in ("slurm", "profiles/slurm"):
        again = dry_run_jobs(workdir, "--profile", profile)
        norm = lambda js: sorted(repr((r, t, sorted(res.items()))) for r, t, res in js)  # noqa: E731
        assert norm(again) == norm(jobs_), profile


def test_eval_jobs_take_the_eval_section_dry_run(workdir):
    # the paper study under the papers' selection (evaluate_all too), with eval values that
    # differ from every training value, and evaluate_all's wall time left to the checkpoints
    path = workdir / "config/paper.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["train"]["selection"] = "test_avg"
    # (0.45 of the GPU and 120 GiB: room for the job's retrieval server, which the DAG checks)
    cfg["eval"] = {"gpus": 1, "threads": 3, "mem_mb": 123456, "runtime_min": 77,
                   "engine_memory_share": 0.45, "chunk": 256}
    path.write_text(yaml.safe_dump(cfg))
    jobs_ = dry_run_jobs(workdir, "--workflow-profile", "profiles/slurm", shell=True)
    seen = set()
    for rule, threads, res, cmd in jobs_:
        if rule not in ("evaluate", "evaluate_all"):
            continue
        seen.add(rule)
        assert threads == 3 and "OMP_NUM_THREADS=3 " in cmd, (rule, threads, cmd)
        assert (res["gpu"], res["mem_mb"]) == ("1", "123456"), (rule, res)
        # 240 steps saved every 20, plus step 0: 13 checkpoints (ReAct trains none: step 0)
        per_ckpt = 1 if rule == "evaluate" or "method~react/" in cmd else 13
        assert int(res["runtime"]) == 77 * per_ckpt, (rule, res, cmd)
        # the engine share reaches `a2tgpo evaluate` as an override of the cell's config,
        # before the list-valued --test
        # a cell path holds '~', so the shell command quotes it
        assert re.search(r"a2tgpo evaluate '\S+/config\.yaml' engine_memory_share=0\.45 "
                         r"--chunk 256 --(best|all-checkpoints) ", cmd), cmd
    assert seen == {"evaluate", "evaluate_all"}


def test_paper_plan_fetches_backbones_and_wraps_jobs_dry_run(workdir):
    """`snakemake --profile slurm --configfile config/paper.yaml -n`: one fetch per backbone on
    the submitting host, and every training job on its node: its own retrieval server, the
    ranks through `a2tgpo launch`, exec'd, the hub offline."""
    paper = yaml.safe_load((workdir / "config/paper.yaml").read_text())
    jobs_ = dry_run_jobs(workdir, "--profile", "slurm", shell=True)
    fetches = sorted(cmd for rule, _, _, cmd in jobs_ if rule == "fetch_backbone")
    assert fetches == [f"a2tgpo fetch-backbone config/backbones/{b}.yaml --out "
                       f"results/paper/models/{b} > results/paper/logs/fetch_backbone/{b}.log "
                       "2>&1" for b in sorted(paper["backbones"])]
    # the e5 encoder too: the index check and every job's retrieval server load it offline
    assert [cmd for rule, _, _, cmd in jobs_ if rule == "fetch_encoder"] == [
        ("a2tgpo fetch-model intfloat/e5-base-v2 --out results/paper/models/encoder > "
         "results/paper/logs/fetch_backbone/encoder.log 2>&1")]
    trains = [cmd for rule, _, _, cmd in jobs_ if rule == "train"]
    assert trains
    for cmd in trains:
        assert re.match(r"HF_HUB_OFFLINE=1 A2TGPO_JOB_CPUS=64 OMP_NUM_THREADS=64 .*exec a2tgpo "
                        r"with-retriever "
                        r"'\S+/config\.yaml' -- a2tgpo launch --nproc 8 --nnodes 1 -- a2tgpo "
                        r"train '\S+/config\.yaml' > ", cmd), cmd
    # the cells load the fetched folder, not the hub id
    import a2tgpo.study as study_lib

    study = study_lib.load_study(ROOT / "config/paper.yaml")
    cell = study_lib.study_cells(study)[study.grid.default[0]][0]
    cfg = study_lib.resolve_cell(study, cell.path)
    assert cfg.backbone.path == f"results/paper/models/{cell.backbone}"
    assert cfg.backbone.revision is None
    assert cfg.retrieval.encoder.model == "results/paper/models/encoder"
    assert study_lib.section(study, "retrieval").encoder.model == "results/paper/models/encoder"
    assert study_lib.section(study, "retrieval.encoder").model == "results/paper/models/encoder"


@pytest.mark.slow
@pytest.mark.cluster
def test_slurm_grid_requeue_cancel_keep_going_and_rerun(cluster, toy_workdir):
    workdir = toy_workdir
    env = cluster
    t0 = time.monotonic()
    done, running_since, cancelled = {}, {}, []
    attempts = 1 + yaml.safe_load((workdir / "profiles/slurm/config.yaml").read_text())["retries"]

    def intervene(table):
        now = time.monotonic()
        jid = find(table, *REQUEUE, states={"RUNNING"})
        if "requeued" not in done and jid:
            # let the job run a little (the jobstep has started), then requeue it
            running_since.setdefault(jid, now)
            if now - running_since[jid] > 2:
                subprocess.run(["scontrol", "requeue", jid], env=env, check=True)
                done["requeued"] = jid
        jid = done.get("requeued")
        if jid and table.get(jid, ("",))[0] == "PENDING":
            # SLURM holds a requeued job ~2 min (BeginTime): once the old run has completed
            # (while it completes, an update of StartTime does not stick), make it eligible
            info = show_job(env, jid)
            if info["JobState"] == "PENDING" and info["Reason"] == "BeginTime":
                subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"],
                               env=env, check=True)
                done["released"] = jid
        # the profile's `retries` resubmits a failed job: cancel every attempt
        jid = find(table, *CANCEL, states={"RUNNING"})
        if jid and jid not in cancelled:
            subprocess.run(["scancel", jid], env=env, check=True)
            cancelled.append(jid)

    rc, out = run_snakemake(workdir, env, workdir / "run1.log", intervene)
    t1 = time.monotonic()
    assert "released" in done and len(cancelled) == attempts, (done, cancelled, out[-4000:])
    requeued = done["requeued"]

    # the cancelled job is reported as a failure (each attempt), and the run exits non-zero ...
    assert rc != 0, out[-4000:]
    assert out.count("Error in rule train") >= attempts, out[-4000:]
    for jid in cancelled:
        assert f"SLURM-job '{jid}' failed, SLURM status is: 'CANCELLED'" in out, out[-4000:]
    # ... after --keep-going finished everything that does not need the cancelled cell
    res = workdir / "results/toy"
    assert (res / "retrieval/recall.json").exists()
    assert (workdir / CELL.format(1) / "eval/summary.json").exists(), out[-4000:]
    assert not (workdir / CELL.format(2) / "summary.json").exists()
    assert not (res / "tables/main.md").exists()
    # the requeued job was requeued (SLURM counts a restart) and its cell completed: by the
    # job's own second run or, where SLURM ends the requeued run FAILED (it did once on a
    # loaded node: "STEP ... CANCELLED DUE TO JOB REQUEUE"), through Snakemake's retry; either
    # way resumed from its checkpoints with every step logged
    info = show_job(env, requeued)
    assert int(info["Restarts"]) >= 1, info
    assert sorted({r["step"] for r in read_metrics(workdir / CELL.format(1))}) == [0, 1, 2]

    # resources as the profile maps them: GPU rules get --gpus (a GRES), never --ntasks-per-gpu
    table = jobs(env)
    for rule, gpus in (("sft", "1"), ("encode_shard", "1"), ("world", None), ("train", None)):
        jid = find(table, rule, "")
        assert jid, (rule, table)
        info = show_job(env, jid)
        tres = info.get("TresPerJob", "")
        if gpus:
            assert tres == f"gres:gpu:{gpus}", (rule, info)
        else:
            assert "gpu" not in tres, (rule, info)
        assert info.get("NumTasks") in ("1", None), (rule, info)
        assert "TresPerTask" not in info or "gpu" not in info["TresPerTask"], (rule, info)
    assert show_job(env, find(table, "sft", ""))["NumCPUs"] == "8"  # profile set-resources
    assert show_job(env, find(table, "train", ""))["NumCPUs"] == "1"  # threads = train.threads

    # a plain rerun completes only what is missing: the cancelled cell and the tables
    before = set(table)
    rc, out2 = run_snakemake(workdir, env, workdir / "run2.log")
    t2 = time.monotonic()
    assert rc == 0, out2[-4000:]
    new = {jid: comment for jid, (_, comment) in jobs(env).items() if jid not in before}
    rules = sorted(re.match(r"rule_(\w+?)(_wildcards_|$)", c).group(1) for c in new.values())
    assert rules == ["evaluate", "train"], new  # select and tables run on the submit host
    assert all("seed~2" in c for c in new.values()), new
    for target in TARGETS:
        assert (workdir / target).exists(), target
    print(f"SLURM test wall time: first run {t1 - t0:.0f} s, rerun {t2 - t1:.0f} s")


# the time-limit test's cell: long enough (in steps) that the training job is still running
# when SLURM's time-limit signal arrives (slurmctld checks time limits every 30 s)
LIMIT_CELL = CELL.format(1)
LIMIT_STEPS = 40


@pytest.mark.slow
@pytest.mark.cluster
def test_slurm_time_limit_mid_step_resumes_to_the_same_weights(cluster, toy_workdir):
    """A training job whose time limit is cut to a minute while it trains: SLURM sends the
    profile's early SIGTERM (--signal=TERM@600: the new limit is closer than that), the
    trainer stops at its next safe point with a checkpoint of its last finished step and exits
    75, Snakemake's retry resumes it, and the cell ends with exactly the weights and metrics of
    an uninterrupted run of the same config outside SLURM.

    The signal is SLURM's own delivery, to every process of the job step: the plugin's batch
    script runs `srun` (step 0), whose Snakemake job process runs the rule's command, and
    SLURM sends SIGCONT and SIGTERM to each process of step 0 (Snakemake's, the trainer and
    anything the trainer started), not to the batch shell. (Measured on this cluster with a
    probe process tree; `scancel --signal=TERM JOB` reaches the same processes. `scancel
    --full` also signals the batch step, whose `srun` then cancels step 0 with SIGKILL at
    once: no process of it saw the SIGTERM.) SLURM records no exit 75: Snakemake's job process
    turns every failure into status 1 and the job's ExitCode reads 1:0, so the trainer's own
    last words are the evidence: its stop line and no traceback after it, in a job that ended
    FAILED (a kill would read CANCELLED or TIMEOUT)."""
    workdir, env = toy_workdir, cluster
    cfg_file = workdir / "config/config.yaml"
    cfg = yaml.safe_load(cfg_file.read_text())
    cfg["grid"]["sets"]["slurmtest"]["seeds"] = [1]
    cfg["train"]["schedule"].update(steps=LIMIT_STEPS, save_every=25, eval_every=20,
                                    keep_last=5)
    cfg_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run = workdir / LIMIT_CELL
    seen = {}

    def logged_step():
        try:
            return max(r["step"] for r in read_metrics(run))
        except (FileNotFoundError, ValueError):
            return 0

    def intervene(table):
        now = time.monotonic()
        if "cut" not in seen:
            jid = find(table, "train", "seed~1", states={"RUNNING"})
            if jid:
                seen.setdefault("running", now)
                if logged_step() >= 3:  # training, not setting up
                    elapsed = int(now - seen["running"]) + 1
                    limit = elapsed + 60
                    subprocess.run(["scontrol", "update", f"JobId={jid}",
                                    f"TimeLimit={limit // 60}:{limit % 60:02d}"], env=env,
                                   check=True)
                    seen.update(cut=jid, cut_at_step=logged_step())
        elif "ended" not in seen and table.get(seen["cut"], ("",))[0] in FINAL_STATES:
            # the first attempt is over: what it left before the retry starts training
            seen.update(ended=table[seen["cut"]][0], step=logged_step(),
                        ckpt=latest_checkpoint(run), log=(
                            workdir / "results/toy/logs" / LIMIT_CELL.split("results/toy/")[1]
                            / "train.log").read_text())

    command = [c for c in COMMAND if c not in TARGETS]
    with open(workdir / "limit.log", "w") as fh:
        proc = subprocess.Popen([*command, f"{LIMIT_CELL}/summary.json"], cwd=workdir, env=env,
                                stdout=fh, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + RUN_TIMEOUT
        while proc.poll() is None:
            assert time.monotonic() < deadline, (workdir / "limit.log").read_text()[-4000:]
            intervene(jobs(env))
            time.sleep(0.25)
    out = (workdir / "limit.log").read_text()
    assert proc.returncode == 0, out[-4000:]
    assert "ended" in seen, (seen, out[-4000:])
    # the first attempt stopped itself (exit 75, a FAILED job to SLURM) mid-run, on the signal:
    # the trainer's stop line, with the checkpoint it left, and nothing after it went wrong
    first = seen["log"]
    assert seen["ended"] == "FAILED", seen
    assert "received SIGTERM" in first, first[-3000:]
    stop = re.search(r"stopping for .+: newest checkpoint step (\d+); exit 75 \(resumable\)",
                     first)
    assert stop and "Traceback" not in first, first[-3000:]
    # mid-run: SLURM signals at its next time-limit check (<= 30 s), which on a loaded machine
    # may come before the step after the cut ends
    assert seen["cut_at_step"] <= seen["step"] < LIMIT_STEPS
    # no finished step lost: the checkpoint it left, and the one the retry resumed from, is the
    # last step it logged
    assert checkpoint_step(seen["ckpt"]) == int(stop[1]) == seen["step"], seen
    text = (workdir / "results/toy/logs" / LIMIT_CELL.split("results/toy/")[1]
            / "train.log").read_text()  # the retry's (each attempt rewrites it)
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", text)
    assert resumed and int(resumed[1]) == seen["step"], text[-3000:]
    # ... and none logged twice
    assert_each_step_logged_once(run, LIMIT_STEPS)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == LIMIT_STEPS

    # the same config, uninterrupted, outside SLURM
    straight = workdir / "straight"
    cell_cfg = yaml.safe_load((run / "config.yaml").read_text())
    cell_cfg["run_dir"] = str(straight)
    (workdir / "straight.yaml").write_text(yaml.safe_dump(cell_cfg))
    local = {k: v for k, v in env.items() if not k.startswith("SLURM")}
    r = subprocess.run([str(BIN / "a2tgpo"), "train", str(workdir / "straight.yaml")],
                       cwd=workdir, env={**local, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    from safetensors.torch import load_file

    a = load_file(latest_checkpoint(straight) / "model" / "model.safetensors")
    b = load_file(latest_checkpoint(run) / "model" / "model.safetensors")
    assert latest_checkpoint(run).name == latest_checkpoint(straight).name
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert learned_summary(straight) == learned_summary(run)
