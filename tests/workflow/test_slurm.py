"""A real SLURM cluster runs the toy grid through profiles/slurm.

tests/workflow/slurm/cluster.sh starts a private single-node cluster on localhost (its own munged,
slurmctld and slurmd, 8 fake GPUs in gres.conf). The toy study of tests/workflow/slurm/
toy_config.yaml (two grpo cells, tiny world) then runs with the command the README gives
(`snakemake --workflow-profile profiles/slurm`). While it runs, the training job of one cell is
requeued (`scontrol requeue`, as a preemption does) and the training job of the other cell is
cancelled (`scancel`). The run must go on with --keep-going: the requeued cell trains again,
is selected and evaluated, the independent retrieval check finishes, and Snakemake reports the
cancelled job's failure and exits non-zero. A plain rerun then completes only what is missing.
Also checked: GPU rules got their GPUs (--gpus, never --ntasks-per-gpu), CPU rules none.

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (`bash tests/workflow/slurm/
cluster.sh install`); skipped with the reason otherwise. About 4-5 minutes on 2 cores.
"""

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
import yaml

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent / "slurm"
BIN = Path(sys.executable).parent
SNAKEMAKE = str(BIN / "snakemake")

# What the test builds. The grid's tables need every cell evaluated; recall.json is a branch of
# the DAG that does not depend on training, so it must finish although a training job fails.
TARGETS = ["results/toy/tables/main.md", "results/toy/retrieval/recall.json"]
CELL = "results/toy/runs/backbone~toy/method~grpo/beta~0/seed~{}"
REQUEUE = ("train", "seed~1")  # rule, and a piece of its wildcards: requeued once while running
CANCEL = ("train", "seed~2")   # cancelled while running: the failure the run must report
# The profile as users run it, plus faster status polling than a real cluster needs (the
# cluster keeps finished jobs in squeue for an hour, so squeue status works with 1 s).
COMMAND = [SNAKEMAKE, *TARGETS, "--workflow-profile", "profiles/slurm",
           "--slurm-init-seconds-before-status-checks", "1",
           "--seconds-between-status-checks", "1",
           "--jobs", "4", "--latency-wait", "5",
           "--configfile", str(HERE / "toy_config.yaml")]
RUN_TIMEOUT = 900

pytestmark = pytest.mark.slow


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
def cluster():
    reason = _missing_prerequisite()
    if reason:
        pytest.skip(reason)
    # not under pytest's tmp dirs: they are mode 0700 and munged runs as user munge
    cdir = Path(tempfile.mkdtemp(prefix="a2tgpo-slurm-"))
    r = subprocess.run(["bash", str(HERE / "cluster.sh"), "start", str(cdir)],
                       capture_output=True, text=True, timeout=120)
    try:
        if r.returncode != 0:
            pytest.skip(f"could not start a local SLURM cluster: {r.stderr[-2000:]}")
        # DIR/bin holds an srun that keeps SLURM_CONF (see cluster.sh); jobs inherit PATH
        env = {**os.environ, "SLURM_CONF": str(cdir / "slurm.conf"),
               "PATH": f"{cdir / 'bin'}:{BIN}:{os.environ['PATH']}:/usr/sbin:/sbin",
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
        yield env
    finally:
        subprocess.run(["bash", str(HERE / "cluster.sh"), "stop", str(cdir)],
                       capture_output=True, text=True, timeout=60)
        shutil.rmtree(cdir, ignore_errors=True)


@pytest.fixture
def workdir(tmp_path):
    """A copy of the workflow files, so runs never touch the checkout's results/."""
    for name in ("Snakefile", "workflow", "config", "profiles"):
        src = ROOT / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, tmp_path / name)
    return tmp_path


def jobs(env):
    """Every job the cluster knows (finished ones stay for MinJobAge): id -> (state, comment).
    The plugin writes `rule_<rule>_wildcards_<wildcards>` into each job's comment."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%T|%500k"], env=env,
                         capture_output=True, text=True, check=True).stdout
    rows = (line.split("|", 2) for line in out.splitlines() if line.strip())
    return {jid.strip(): (state.strip(), comment.strip()) for jid, state, comment in rows}


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


def test_slurm_grid_requeue_cancel_keep_going_and_rerun(cluster, workdir):
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
        if jid and "released" not in done and table.get(jid, ("",))[0] == "PENDING":
            # SLURM holds a requeued job ~2 min (BeginTime): make it eligible at once
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
    # the requeued job ran twice and completed
    info = show_job(env, requeued)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, info

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
