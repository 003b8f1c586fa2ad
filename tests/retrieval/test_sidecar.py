"""A job's own retrieval server (a2tgpo.ops.sidecar, `a2tgpo with-retriever`)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from a2tgpo.ops.sidecar import ENV_URL, RetrieverStartError, run_with_retriever
from a2tgpo.retrieval.base import HttpConfig
from a2tgpo.retrieval.retriever import RetrievalConfig, build_retriever

REPO = Path(__file__).resolve().parents[2]

# the job: search once through the URL it was given, record the answer, exit 75 (preempted);
# with "wait", first block until SIGTERM arrives, then search once more (as a trainer finishing
# its rollout wave does) before exiting
JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    from a2tgpo.retrieval.http import HttpRetriever
    out = sys.argv[1]
    client = HttpRetriever(os.environ["A2TGPO_RETRIEVER_URL"], retries=1)
    hits = client.search(["Paris"], 2)
    got = {"url": os.environ["A2TGPO_RETRIEVER_URL"], "ids": [h.id for h in hits[0]]}
    if len(sys.argv) > 2:
        signalled = []
        signal.signal(signal.SIGTERM, lambda s, f: signalled.append(s))
        open(out + ".waiting", "w").close()
        while not signalled:
            time.sleep(0.1)
        time.sleep(1.0)  # the server got its SIGTERM too by now
        after = [h.id for h in client.search(["Paris"], 2)[0]]
        json.dump({**got, "signal": signalled[0], "after": after}, open(out, "w"))
    else:
        json.dump(got, open(out, "w"))
    sys.exit(75)
""")


def _bm25(**http) -> RetrievalConfig:
    return RetrievalConfig(retriever="bm25", mode="http", http=HttpConfig(serve="job", **http))


def _server_gone(state: Path) -> bool:
    pid = json.loads((state / "retriever.ready.json").read_text())["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_job_searches_its_own_server_which_is_stopped_after(world_dir, tmp_path, caplog):
    caplog.set_level("INFO", logger="a2tgpo.ops.sidecar")
    out = tmp_path / "job.json"
    status = run_with_retriever(_bm25(), str(world_dir / "corpus.jsonl"), None,
                                [sys.executable, "-c", JOB, str(out)], tmp_path / "state")
    assert status == 75  # the job's own status, passed through
    got = json.loads(out.read_text())
    assert got["url"].startswith("http://127.0.0.1:") and len(got["ids"]) == 2
    assert _server_gone(tmp_path / "state")
    text = caplog.text
    assert "retrieval server ready at " + got["url"] in text
    assert "retrieval server stopped" in text


@pytest.mark.parametrize("state_dir", [None, "trial/retriever"])
def test_sigterm_reaches_the_job_and_the_server_still_stops(world_dir, tmp_path, state_dir):
    """A SLURM time limit signals the job's processes: the job gets the signal (to checkpoint),
    the server goes on serving it, and the wrapper exits with the job's status after stopping
    the server. The server's files go in the run folder, or in --state-dir (sweep trials)."""
    from a2tgpo.algo.methods import METHODS
    from a2tgpo.config import dump_config
    from a2tgpo.model.backbone import BackboneConfig
    from a2tgpo.train.config import TrainConfig

    # a cell config as the DAG writes it; with-retriever reads its run_dir, corpus, index and
    # retrieval section
    path = tmp_path / "cell.yaml"
    dump_config(TrainConfig(run_dir=str(tmp_path / "run"), results_dir=str(tmp_path),
                            backbone=BackboneConfig(id="toy", path="unused"),
                            method=METHODS["grpo"], train_file="unused", dev_file="unused",
                            corpus=str(world_dir / "corpus.jsonl"), retrieval=_bm25()), path)
    out = tmp_path / "job.json"
    where = tmp_path / (state_dir or "run/retriever")
    extra = ["--state-dir", str(where)] if state_dir else []
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "a2tgpo.cli", "with-retriever", str(path), *extra, "--",
         sys.executable, "-c", JOB, str(out), "wait"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not Path(str(out) + ".waiting").exists():
            assert wrapper.poll() is None, wrapper.stdout.read()
            assert time.monotonic() < deadline, "the job did not start within 60 s"
            time.sleep(0.1)
        # SLURM signals every process of the job: the wrapper (which passes it on to the job)
        # and the server, which must keep serving until the job is done
        server = json.loads((where / "retriever.ready.json").read_text())["pid"]
        wrapper.send_signal(signal.SIGTERM)
        os.kill(server, signal.SIGTERM)
        log, _ = wrapper.communicate(timeout=60)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
    assert wrapper.returncode == 75, log
    got = json.loads(out.read_text())
    assert got["signal"] == signal.SIGTERM and got["after"] == got["ids"]  # still served
    assert _server_gone(where)
    assert "retrieval server stopped" in log
    assert (where / "retriever.log").is_file()


def test_a_server_that_cannot_start_names_the_index(world_dir, tmp_path):
    dense = RetrievalConfig(mode="http", http=HttpConfig(serve="job"))
    missing = tmp_path / "nowhere.faiss"
    with pytest.raises(RetrieverStartError, match=f"index {missing} .* exited with status"):
        run_with_retriever(dense, str(world_dir / "corpus.jsonl"), str(missing),
                           [sys.executable, "-c", "pass"], tmp_path / "state")


def test_the_client_takes_the_jobs_url_and_refuses_to_guess_without_it(monkeypatch):
    monkeypatch.delenv(ENV_URL, raising=False)
    with pytest.raises(ValueError, match="serve is job but A2TGPO_RETRIEVER_URL is not set"):
        build_retriever(_bm25(), "unused.jsonl", None)
    monkeypatch.setenv(ENV_URL, "http://127.0.0.1:1/retrieve")
    assert build_retriever(_bm25(), "unused.jsonl", None).url == "http://127.0.0.1:1/retrieve"


def test_paper_jobs_run_under_their_own_retrieval_server(workdir):
    run = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--configfile",
                          "config/paper.yaml", "--forceall"], cwd=workdir, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    commands = [line for line in run.stdout.splitlines()
                if " train 'results/" in line or "a2tgpo evaluate " in line]
    assert commands
    for cmd in commands:
        # the wrapper comes first and reads the same cell config the job does (quoted: a
        # cell path holds '~')
        cfg = cmd.split("a2tgpo with-retriever ", 1)[1].split(" -- ", 1)[0]
        assert cfg.startswith("'results/") and cfg.endswith("/config.yaml'"), cmd
        assert cmd.count(cfg) == 2, cmd


def test_paper_sweep_trials_run_under_their_own_retrieval_servers(workdir):
    # an Optuna sweep on the paper study: each trial starts its own server, in a folder of its
    # own (trials share the base config, so its run folder would be shared)
    cfg = yaml.safe_load((workdir / "config/paper.yaml").read_text())
    sweep = {"name": "paper_beta", "n_trials": 2,
             "base": {"backbone": "qwen3-4b", "method": "a2tgpo", "track": "multi_hop"},
             "search": {"beta": {"low": 0.0, "high": 0.5}}}
    (workdir / "config/sweeps/paper_beta.yaml").write_text(yaml.safe_dump(sweep))
    cfg["sweeps"] = ["config/sweeps/paper_beta.yaml"]
    (workdir / "config/sweep.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "snakemake", "sweep_paper_beta", "-n", "-p",
                          "--configfile", "config/sweep.yaml"], cwd=workdir,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    trials = [line for line in run.stdout.splitlines() if "a2tgpo sweep-trial" in line]
    assert len(trials) == 2
    for i, cmd in enumerate(sorted(trials, key=lambda c: c.split("--index ")[1])):
        base = "results/paper/sweeps/paper_beta/base.yaml"
        assert f"exec a2tgpo with-retriever {base} --state-dir results/paper/sweeps/" \
               f"paper_beta/trials/{i}/retriever -- a2tgpo sweep-trial " in cmd, cmd
