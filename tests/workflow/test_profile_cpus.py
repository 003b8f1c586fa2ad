"""Grid jobs get the CPUs their study config asks for, whatever host Snakemake runs on, and a
job that got fewer says so at start (a2tgpo/ops/job_cpus.py).

Snakemake caps a job's `threads` at --cores even for SLURM jobs, and profiles/default's
`cores: all` makes that the submitting host's count, so the rules request CPUs with the resource
cpus_per_task instead (workflow/rules/common.smk, job_cpus_env). The dry run below runs
Snakemake as users do (`--profile slurm`, no --cores) on one CPU of this host, whatever the host
has, so the cap is in effect."""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from snakemake_executor_plugin_slurm_jobstep import get_cpu_setting

from a2tgpo.config import ConfigError
from a2tgpo.ops.job_cpus import ENV, THREAD_VARS, check_job_cpus, granted_cpus

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


class _Resources(dict):
    """A job's resources as the SLURM plugin reads them: `.get(name)` and `.name`."""

    __getattr__ = dict.__getitem__


def _one_cpu():
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def paper_dry_run(workdir):
    """(rule, threads, resources, shell command) of every job of `snakemake -n -p --profile slurm
    --configfile config/paper.yaml`, Snakemake pinned to one CPU."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    r = subprocess.run([str(BIN / "snakemake"), "-n", "-p", "--profile", "slurm",
                        "--configfile", "config/paper.yaml"],
                       cwd=workdir, env=env, capture_output=True, text=True, timeout=300,
                       preexec_fn=_one_cpu)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = []
    for block in re.split(r"\n(?=rule \w+:\n)", r.stdout):
        m = re.match(r"rule (\w+):\n", block)
        if not m:
            continue
        threads = re.search(r"^    threads: (\d+)$", block, re.M)
        res = re.search(r"^    resources: (.*)$", block, re.M)
        cmd = re.search(r"^Shell command: (.*)$", block, re.M)
        res = dict(kv.split("=", 1) for kv in res.group(1).split(", ")) if res else {}
        jobs.append((m.group(1), int(threads.group(1)) if threads else 1,
                     _Resources({k: int(v) if v.isdigit() else v for k, v in res.items()}),
                     cmd.group(1) if cmd else ""))
    return jobs


@pytest.fixture
def workdir(workdir):
    (workdir / "slurm").symlink_to(os.readlink(ROOT / "slurm"))  # `--profile slurm`
    return workdir


def test_grid_jobs_get_the_configs_cpus_from_a_one_core_host_dry_run(workdir):
    path = workdir / "config/paper.yaml"
    cfg = yaml.safe_load(path.read_text())
    # eval.threads apart from train.threads (both 64 in the paper study), so a job given the
    # other section's value fails; test_avg adds evaluate_all, which takes eval.threads too
    cfg["eval"]["threads"] = 24
    cfg["train"]["selection"] = "test_avg"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    want = {"train": cfg["train"]["threads"], "evaluate": 24, "evaluate_all": 24}
    assert min(want.values()) > 1  # more than the one CPU Snakemake runs on

    seen = {}
    for rule, threads, res, cmd in paper_dry_run(workdir):
        if rule not in want:
            continue
        n = want[rule]
        seen[rule] = seen.get(rule, 0) + 1
        # the host's cap is in effect: Snakemake's own `threads` are 1 here ...
        assert threads == 1, (rule, threads)
        # ... yet SLURM is asked for the config's CPUs: the plugin's sbatch (and srun) flag,
        # from the job as the dry run shows it
        job = type("Job", (), {"threads": threads, "resources": res})()
        assert get_cpu_setting(job, True) == f"--cpus-per-task={n}", (rule, res)
        # and the job's thread counts and the number its start-up check compares with
        for var in (ENV, *THREAD_VARS):
            assert f" {var}={n} " in cmd, (rule, var, cmd)
    # 84 cells: one train and one evaluate job each, evaluate_all under test_avg
    assert seen == {"train": 84, "evaluate": 84, "evaluate_all": 84}, seen


# --------------------------------------------------------------------------------------------
# the start-up check


def test_granted_cpus_is_the_smaller_of_affinity_and_slurm():
    assert granted_cpus({}, set(range(8))) == (8, "CPU affinity 8")
    assert granted_cpus({"SLURM_CPUS_PER_TASK": "4"}, set(range(8))) == (
        4, "CPU affinity 8, SLURM_CPUS_PER_TASK=4")
    # a cgroup narrower than the request: the affinity is what the job can use
    assert granted_cpus({"SLURM_CPUS_PER_TASK": "64"}, {0, 1})[0] == 2


def test_job_with_fewer_cpus_than_configured_warns_once_naming_the_key(caplog):
    caplog.set_level(logging.WARNING, logger="a2tgpo.ops.job_cpus")
    msg = check_job_cpus("train.threads", {ENV: "64", "SLURM_CPUS_PER_TASK": "2"},
                         set(range(96)))
    assert msg is not None
    assert "train.threads = 64" in msg and "this job has 2 " in msg, msg
    assert [r.getMessage() for r in caplog.records] == [msg]
    assert caplog.records[0].levelno == logging.WARNING

    caplog.clear()
    msg = check_job_cpus("eval.threads", {ENV: "24"}, {0, 1, 2})
    assert "eval.threads = 24" in msg and "this job has 3 " in msg, msg
    assert len(caplog.records) == 1


def test_job_with_enough_cpus_or_no_request_is_quiet(caplog):
    caplog.set_level(logging.DEBUG, logger="a2tgpo.ops.job_cpus")
    assert check_job_cpus("train.threads", {ENV: "64", "SLURM_CPUS_PER_TASK": "64"},
                          set(range(64))) is None
    assert check_job_cpus("train.threads", {}, {0}) is None  # started by hand: nothing asked
    # launched ranks share the job's CPUs: local rank 0 speaks for the node
    assert check_job_cpus("train.threads", {ENV: "64", "LOCAL_RANK": "3"}, {0}) is None
    assert caplog.records == []
    assert check_job_cpus("train.threads", {ENV: "64", "LOCAL_RANK": "0"}, {0}) is not None


def test_malformed_request_names_the_variable():
    with pytest.raises(ConfigError, match=rf"{ENV}='sixty'.*train\.threads"):
        check_job_cpus("train.threads", {ENV: "sixty"}, {0})
    with pytest.raises(ConfigError, match=rf"{ENV}='0'"):
        check_job_cpus("train.threads", {ENV: "0"}, {0})


@pytest.mark.parametrize("command,key", [("train", "train.threads"),
                                         ("evaluate", "eval.threads")])
def test_train_and_evaluate_commands_check_at_start(command, key, tmp_path, monkeypatch,
                                                    caplog):
    """`a2tgpo train|evaluate` warns before it reads its config (here a missing one, so the
    command ends there): more CPUs asked than any host has."""
    from a2tgpo.cli import main

    caplog.set_level(logging.WARNING, logger="a2tgpo.ops.job_cpus")
    monkeypatch.setenv(ENV, "100000")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = [command, str(tmp_path / "missing.yaml")]
    if command == "evaluate":
        args += ["--all-checkpoints", "--test", "x", "--out", str(tmp_path / "out")]
    assert main(args) != 0
    warned = [r.getMessage() for r in caplog.records if r.name == "a2tgpo.ops.job_cpus"]
    assert len(warned) == 1 and warned[0].startswith(f"{key} = 100000 "), warned
