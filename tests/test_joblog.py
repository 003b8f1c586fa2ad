"""A job's log: a header saying what the job is, a closing line saying how it went, and no
third-party noise (faiss's loader, DeepSpeed's accelerator notice, Hugging Face's bars)."""

import hashlib
import io
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from a2tgpo.ops import joblog

A2TGPO = str(Path(sys.executable).parent / "a2tgpo")


def test_a_commands_log_begins_with_what_it_is_and_ends_with_how_it_went(tmp_path):
    cfg = tmp_path / "w.yaml"
    cfg.write_text("seed: 3\ncountries: 4\ncities: 8\npeople: 20\nfilms: 12\nbands: 6\n"
                   "companies: 8\ndistractors: 5\nqa_sets:\n"
                   "  - {name: s, group: single_hop, splits: {test: 5}, mix: {single: 1.0}}\n")
    log = tmp_path / "world.log"
    argv = ["world", str(cfg), "seed=4", "--out", str(tmp_path / "w")]
    with open(log, "w") as f:
        subprocess.run([A2TGPO, *argv], stderr=f, stdout=subprocess.DEVNULL, check=True,
                       timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [ln.split("a2tgpo.job: ", 1)[1] for ln in log.read_text().splitlines()
             if "a2tgpo.job: " in ln]
    digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:12]
    assert lines[0] == "a2tgpo world"
    assert lines[1] == f"command: a2tgpo world {cfg} seed=4 --out {tmp_path / 'w'}"
    assert lines[2].startswith(f"config {cfg} (sha256 {digest}) · host {socket.gethostname()}")
    # an empty CUDA_VISIBLE_DEVICES hides every GPU
    assert lines[3].startswith("devices: no GPU (CUDA_VISIBLE_DEVICES=)")
    assert lines[-1].startswith("a2tgpo world finished in ")
    assert lines[-1].endswith(f" s; outputs in {tmp_path / 'w'}")


def test_the_header_names_the_cell_of_its_config(tmp_path, caplog):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("backbone:\n  id: toy\ncell: backbone~toy/method~grpo/beta~0/seed~1\n")
    caplog.set_level(logging.INFO, logger="a2tgpo.job")
    lines = joblog.begin("train", ["a2tgpo", "train", str(cfg)], cfg)
    assert lines[0] == "a2tgpo train · cell backbone~toy/method~grpo/beta~0/seed~1"
    assert [r.getMessage() for r in caplog.records] == lines


@pytest.mark.parametrize("rc, summary, out, text", [
    (0, "grpo, 2 steps; best dev EM 0.250 at step 2 -> runs/c", None,
     "a2tgpo train finished in 3m07s: grpo, 2 steps; best dev EM 0.250 at step 2 -> runs/c"),
    (75, None, "runs/c", "a2tgpo train stopped, resumable (exit 75) in 3m07s; outputs in runs/c"),
    (2, None, None, "a2tgpo train failed (exit 2) in 3m07s"),
])
def test_the_closing_line(rc, summary, out, text):
    assert joblog.end("train", rc, 187.0, summary, out) == text


def test_one_header_per_log_file(tmp_path):
    env = {}
    with open(tmp_path / "a.log", "w") as a, open(tmp_path / "b.log", "w") as b:
        # with-retriever marks its log; the train command it runs into the same file skips
        # the header, one writing a file of its own (sweep-trial --log) does not
        assert joblog.header_due(a, env, mark=True) and joblog.ENV_BEGUN in env
        assert not joblog.header_due(a, env)
        assert joblog.header_due(b, env)
        assert not joblog.header_due(b, {"RANK": "1"})  # rank 0 speaks for the ranks
    assert joblog.header_due(io.StringIO(), {})  # no file to tell by: a header

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert not joblog.header_due(Tty(), {})  # a person at a terminal typed the command


def test_devices_read_from_the_driver_and_cuda_visible_devices(tmp_path):
    for bus, uuid, model in (("0000:01:00.0", "GPU-aaa", "NVIDIA H100 80GB HBM3"),
                             ("0000:02:00.0", "GPU-bbb", "NVIDIA H100 80GB HBM3"),
                             ("0000:03:00.0", "GPU-ccc", "NVIDIA A100-SXM4-40GB")):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            f"Model: \t\t {model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n")

    def dev(**env):
        return joblog.devices({"SLURM_CPUS_PER_TASK": "4", **env}, tmp_path).split(";")[0]

    assert dev() == "2 × NVIDIA H100 80GB HBM3, 1 × NVIDIA A100-SXM4-40GB"
    assert dev(CUDA_VISIBLE_DEVICES="2,0") == (
        "1 × NVIDIA A100-SXM4-40GB, 1 × NVIDIA H100 80GB HBM3 (CUDA_VISIBLE_DEVICES=2,0)")
    assert dev(CUDA_VISIBLE_DEVICES="GPU-bbb") == (
        "1 × NVIDIA H100 80GB HBM3 (CUDA_VISIBLE_DEVICES=GPU-bbb)")
    # CUDA stops at the first id it cannot match (-1 hides every GPU)
    assert dev(CUDA_VISIBLE_DEVICES="1,-1,2") == (
        "1 × NVIDIA H100 80GB HBM3 (CUDA_VISIBLE_DEVICES=1,-1,2)")
    assert joblog.devices({"SLURM_CPUS_PER_TASK": "1"}, tmp_path / "none") == "no GPU; 1 CPUs"


# faiss (its loader's fallbacks), DeepSpeed (its accelerator notice on a CPU-only machine) and
# transformers (its weight-loading bar) imported and used as a job uses them
NOISY = """
from a2tgpo.ops.joblog import setup_logging
setup_logging()
import faiss
from deepspeed.accelerator import get_accelerator
get_accelerator()
from transformers.utils import logging as hf_logging
for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
    pass
print(hf_logging.is_progress_bar_enabled())
"""


def test_third_party_noise_stays_out_of_a_job_log(tmp_path):
    log = tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "DS_"))}
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, "-c", NOISY], stderr=f, stdout=subprocess.PIPE,
                           text=True, check=True, timeout=120, env={**env,
                                                                    "CUDA_VISIBLE_DEVICES": ""})
    assert r.stdout.split() == ["False"]  # transformers' bars off into a file
    text = log.read_bytes().decode() + r.stdout  # read_text() would turn each \r into \n
    for noise in ("faiss.loader", "faiss with", "No module named", "Setting accelerator",
                  "Loading weights", "\r"):
        assert noise not in text, (noise, text)
