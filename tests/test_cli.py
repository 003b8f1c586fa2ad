"""The CLI explains itself and runs the stage commands end to end."""

import contextlib
import json
import subprocess
import sys

import pytest

from a2tgpo.cli import build_parser, main

COMMANDS = ["world", "toy-backbone", "toy-reader", "prepare-data", "download-corpus",
            "encode-corpus", "build-index", "check-index", "serve-retriever", "search",
            "retrieval-eval",
            "sft", "train", "rerun", "evaluate", "select", "methods", "plan", "with-retriever",
            "launch", "fetch-backbone", "fetch-model", "serve-hub", "rehearse", "check-config",
            "resolve", "config-doc", "tables", "plots", "sweep-trial", "sweep-summary",
            "sync-mlflow"]


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in COMMANDS:
        assert cmd in out
    # the parser and this list agree, so a new command cannot go undocumented here
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: a2tgpo {cmd}" in out
    help_text = next(a for a in build_parser()._actions if a.dest == "command").choices[cmd]
    assert help_text.description and len(help_text.description) > 60  # says what it does


def test_world_command_with_overrides(tmp_path, capsys):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("seed: 3\ncountries: 4\ncities: 8\npeople: 30\nfilms: 12\nbands: 6\n"
                   "companies: 8\ndistractors: 5\nqa_sets:\n"
                   "  - {name: s, group: single_hop, splits: {test: 5}, mix: {single: 1.0}}\n")
    assert main(["world", str(cfg), "people=20", "--out", str(tmp_path / "w")]) == 0
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["entities"]["person"] == 20 and summary["seed"] == 3
    assert "toy world" in capsys.readouterr().out


def test_config_error_exit_code_and_message(tmp_path, capsys):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("seed: 3\npeeple: 4\n")
    assert main(["world", str(cfg), "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert f"{cfg}: peeple: unknown key (did you mean 'people'?)" in err
    assert not (tmp_path / "w").exists()  # nothing written for an invalid config


# --------------------------------------------------------------------------------------------
# rerun: nothing destroys a live run

# holds the run folder's lock as training does (rl._run_folder_lock), says so, then waits
LOCK_HOLDER = """
import sys, time
from a2tgpo.ops.lock import folder_lock
with folder_lock(sys.argv[1], "run folder"):
    print("held", flush=True)
    time.sleep(600)
"""


@contextlib.contextmanager
def lock_held(run):
    """Another process holds `run`'s lock (LOCK_HOLDER) inside the block; yields it."""
    p = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(run)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield p
    finally:
        p.kill()
        p.wait()


CELL_SELECTORS = ["data=multi_hop", "method=a2tgpo", "beta=0.3", "seed=1"]
CELL = "backbone~toy_reader/data~multi_hop/method~a2tgpo/beta~0.3/seed~1"


@pytest.fixture
def rerun_study(tmp_path, monkeypatch):
    """The toy study with its results under tmp_path, one cell's run folder with a file in it,
    and Snakemake replaced by a recorder: returns (rerun(*args) -> rc, run folder, calls)."""
    from pathlib import Path

    import yaml

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    results = tmp_path / "results"
    run = results / "toy" / "runs" / CELL
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = yaml.safe_load(Path("config/config.yaml").read_text())
    cfg["results_dir"] = str(results)
    for source in cfg["data"]["train"] + cfg["data"]["test"]:  # the toy world's QA folder
        source["repo"] = source["repo"].replace("results/", f"{results}/", 1)
    configfile = tmp_path / "config.yaml"
    configfile.write_text(yaml.safe_dump(cfg))
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: calls.append(cmd) or 0)

    def rerun(*args):
        return main(["rerun", *CELL_SELECTORS, "--configfile", str(configfile), *args])

    return rerun, run, calls


def test_rerun_refuses_a_run_folder_in_use_naming_the_holder(rerun_study, capsys):
    import socket

    rerun, run, calls = rerun_study
    with lock_held(run) as p:
        assert rerun("--", "--cores", "2") == 1
    err = capsys.readouterr().err
    # the holder as the lock file records it: pid, host and its command (argv[:3]; for
    # `python -c CODE RUN` that is "-c RUN")
    assert f"cell {CELL}: run folder {run} is in use by pid {p.pid} on host " \
           f"{socket.gethostname()} since " in err
    assert f"(-c {run})" in err and "Nothing was moved." in err
    assert (run / "metrics.jsonl").is_file() and not (run.parents[5] / "archive").exists()
    assert calls == []  # Snakemake never started
    # the holder gone (its lock with it), the same command moves the folder, then runs
    assert rerun("--", "--cores", "2") == 0
    assert not run.exists()
    [moved] = (run.parents[5] / "archive" / CELL).iterdir()
    assert (moved / "metrics.jsonl").is_file()
    assert calls[0][-2:] == ["--cores", "2"]


@pytest.mark.parametrize("flags", [["-n"], ["--dry-run"], ["--dryrun"], ["-pn"],
                                   ["--cores", "2", "-kpn"]])
def test_a_snakemake_dry_run_through_rerun_moves_nothing(rerun_study, capsys, flags):
    rerun, run, calls = rerun_study
    assert rerun("--", *flags) == 0
    out = capsys.readouterr().out
    assert f"dry run, nothing is moved: would archive {run} to " \
           f"{run.parents[5] / 'archive' / CELL}/" in out
    assert (run / "metrics.jsonl").is_file() and not (run.parents[5] / "archive").exists()
    [cmd] = calls  # Snakemake's own dry run still shows the jobs the rerun would start
    assert cmd[-len(flags):] == flags


def test_rerun_dry_run_says_a_busy_folder_would_be_refused(rerun_study, capsys):
    rerun, run, calls = rerun_study
    with lock_held(run) as p:
        assert rerun("--dry-run") == 0
    out = capsys.readouterr().out
    assert f"would archive {run} to " in out
    assert f"refused now: the run folder is in use by pid {p.pid} on host" in out
    assert calls == [] and (run / "metrics.jsonl").is_file()


def test_rerun_refuses_snakemake_arguments_snakemake_refuses(rerun_study, capsys):
    rerun, run, calls = rerun_study
    # ambiguous to Snakemake (--dry-run or --dryrun): it would stop before running anything
    assert rerun("--", "--dry") == 2
    err = capsys.readouterr().err
    assert "Snakemake refuses the arguments after --: ambiguous option: --dry" in err
    assert "nothing was moved" in err
    assert (run / "metrics.jsonl").is_file() and calls == []


def test_rerun_refuses_while_a_snakemake_run_locks_the_cells_files(rerun_study, tmp_path,
                                                                   capsys):
    """A Snakemake run that evaluates the cell (its jobs hold no run-folder lock) still locks
    the cell's files in <workdir>/.snakemake/locks, where rerun looks before it moves."""
    import os

    rerun, run, calls = rerun_study
    wd = tmp_path / "wd"
    locks = wd / ".snakemake" / "locks"
    locks.mkdir(parents=True)
    # as Snakemake's file backend writes them: one path per line, relative to its workdir
    lock = locks / "0.input.lock"
    lock.write_text(f"results/toy/tables/report.yaml\n{os.path.relpath(run, wd)}/best.json\n")
    assert rerun("--", "--directory", str(wd), "--cores", "2") == 1
    err = capsys.readouterr().err
    assert f"a Snakemake run in {wd} holds locks on files of {run} ({lock})" in err
    assert "`snakemake --unlock`" in err and "Nothing was moved." in err
    assert (run / "metrics.jsonl").is_file() and calls == []
    assert rerun("--", "--directory", str(wd), "-n") == 0  # a dry run says so
    assert f"refused now: a Snakemake run in {wd} holds locks" in capsys.readouterr().out
    # locks on other cells' files only: the cell moves
    lock.write_text(f"{run.with_name('seed~2')}/best.json\n")
    assert rerun("--", "--directory", str(wd), "--cores", "2") == 0
    assert not run.exists() and len(calls) == 2
