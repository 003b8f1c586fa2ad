"""A job's peak memory (a2tgpo.train.memory.job_peak) and what a training run logs of its
machine: mlflow's system metrics while it runs, its peak memory at the end."""

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from a2tgpo.algo.methods import METHODS
from a2tgpo.train import memory
from a2tgpo.train.config import ScheduleConfig
from a2tgpo.train.memory import GIB

CHILD_MIB = 256


def test_the_host_peak_counts_the_process_and_its_children_running_or_ended():
    """In a fresh process (no earlier children): a child that touched CHILD_MIB MiB counts while
    it runs (its VmHWM) and after it ended (getrusage RUSAGE_CHILDREN)."""
    code = textwrap.dedent(f"""
        import json, subprocess, sys
        from a2tgpo.train.memory import job_peak
        child = subprocess.Popen([sys.executable, "-c",
            "import sys; b = b'x' * ({CHILD_MIB} << 20); print(1, flush=True); sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        child.stdout.readline()  # its memory is written (a zeroed bytearray might be untouched)
        running = job_peak("p")
        child.stdin.close(); child.wait()
        print(json.dumps([running, job_peak("p")]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    running, ended = json.loads(r.stdout.splitlines()[-1])
    for peak in (running, ended):
        assert peak["p/host_children_gib"] >= CHILD_MIB / 1024
        # the process imported torch: 50 MiB to 8 GiB resident (ru_maxrss counts KiB on Linux:
        # read as bytes, it would be 1024x less)
        assert 0.05 < peak["p/host_gib"] < 8
        assert "p/gpu_reserved_gib" not in peak  # no CUDA used


def test_the_host_peak_is_at_least_what_the_process_holds_now():
    import psutil

    me = psutil.Process()
    now = me.memory_info().rss
    # Linux counts a thread's resident pages in batches of up to 64 pages before the process's
    # count sees them, so /proc's number and getrusage's may differ by 64 pages per thread
    slack = me.num_threads() * 64 * 4096
    assert memory.job_peak("p")["p/host_gib"] >= (now - slack) / GIB


def test_the_jobs_gpu_peak_outlives_the_phase_resets(monkeypatch):
    """PhaseMemory resets the allocator's peak at each boundary; the job's peak is the most of
    any phase. A stand-in for torch.cuda's peak counter: one device, 3 GiB in the first phase,
    1 GiB in the next."""
    peak = {"bytes": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: peak["bytes"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: peak.update(bytes=0))
    monkeypatch.setattr(memory, "_reserved_before_reset", 0)
    peak["bytes"] = 3 * GIB
    memory.reset_peak("cuda:0")
    peak["bytes"] = 1 * GIB
    assert memory.job_peak("p")["p/gpu_reserved_gib"] == 3.0


@pytest.mark.expensive  # ~22 s on 2 cores (a fresh MLflow store, one step), after the toy
# world's warm start (shared with test_rl): CI runs it in its expensive step (.ci/run)
def test_a_training_run_logs_system_metrics_and_its_peak_memory(toy_train_config, tmp_path):
    import psutil
    from mlflow import MlflowClient

    from a2tgpo.tracking import TrackingConfig, resolve_tracking_uri
    from a2tgpo.train.rl import train

    method = dataclasses.replace(METHODS["grpo"], rollout=dataclasses.replace(
        METHODS["grpo"].rollout, n=4))
    cfg = toy_train_config(
        tmp_path / "run", method, tracking=TrackingConfig(system_metrics_interval_s=0.5),
        schedule=ScheduleConfig(steps=1, prompts_per_step=2, mini_batch_prompts=1,
                                micro_batch_size=4, eval_every=1, eval_questions=2))
    rss_before = psutil.Process().memory_info().rss
    train(cfg)
    run_id = json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"]
    client = MlflowClient(tracking_uri=resolve_tracking_uri(cfg.tracking, cfg.results_dir))
    metrics = client.get_run(run_id).data.metrics
    cpu = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert cpu and [p.step for p in cpu] == list(range(len(cpu)))
    assert "system/system_memory_usage_megabytes" in metrics
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    peak = summary["peak_memory/train/host_gib"]
    assert metrics["peak_memory/train/host_gib"] == pytest.approx(peak)
    # the job is this process: its peak is at least what it held before training
    assert rss_before / GIB <= peak <= psutil.virtual_memory().total / GIB
    assert "peak_memory/train/host_children_gib" in summary
    assert "peak_memory/train/gpu_reserved_gib" not in summary  # trained on CPU
