"""scripts/setup_gpu_env.sh checks the GPU stack's preconditions before it downloads anything:
an NVIDIA driver >= 580 (torch 2.14.0 and vLLM 0.33.0 from PyPI are CUDA 13.0 builds) and
compute mode Default on every GPU (a trainer rank, its vLLM engine and the retrieval server share
each one). The checks run against a fake `nvidia-smi` that prints what the real one prints for
the script's query; the PATH holds nothing else but the few tools the script's start needs, so
no real nvidia-smi or python of this host takes part. scripts/gpu_smoke.py, run after
installing, is checked in the CPU vLLM environment and, on a GPU, in the GPU one."""

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup_gpu_env.sh"
SMOKE = ROOT / "scripts" / "gpu_smoke.py"
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
# written last by scripts/setup_vllm_cpu.sh: a venv still being built (CI builds it beside the
# main suite) has none
VLLM_STAMP = ROOT / ".venv-vllm" / ".a2tgpo-vllm-stamp"
QUERY = "--query-gpu=index,driver_version,compute_mode,name --format=csv,noheader"
# the tools the script runs before its GPU check, and the fakes' `touch`
TOOLS = ("dirname", "realpath", "cat", "sha256sum", "cut", "rm", "uname", "grep", "touch")
BASH = shutil.which("bash")
H100 = "NVIDIA H100 80GB HBM3"


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def run_script(tmp_path, smi_lines=None, smi_rc=0, args=("--check-only",), env=None):
    """Run the script with PATH = a fake nvidia-smi (None: no nvidia-smi) and the TOOLS.
    The fake answers the script's query only, so a changed query fails here, not on a node; it
    prints `smi_lines` and exits `smi_rc`. PYTHON is a fake that leaves a mark: the check must
    come before the venv, so before any download."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        if not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(shutil.which(tool))
    if smi_lines is not None:
        body = "\n".join(smi_lines)
        _executable(bin_dir / "nvidia-smi", f"""#!{BASH}
if [[ "$*" != "{QUERY}" ]]; then echo "fake nvidia-smi: unexpected arguments: $*" >&2; exit 2; fi
printf '%s\\n' "{body}"
exit {smi_rc}
""")
    mark = tmp_path / "python-ran"
    _executable(bin_dir / "fake-python", f"#!{BASH}\ntouch {mark}\nexit 1\n")
    full_env = {"PATH": str(bin_dir), "HOME": str(tmp_path),
                "PYTHON": str(bin_dir / "fake-python"), **(env or {})}
    r = subprocess.run([BASH, str(SCRIPT), *args], env=full_env,
                       capture_output=True, text=True, timeout=60)
    return r, mark.exists()


def test_driver_550_fails_naming_580(tmp_path):
    r, _ = run_script(tmp_path, [f"0, 550.54.15, Default, {H100}"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "NVIDIA driver 550.54.15 is too old" in r.stderr, r.stderr
    assert "driver >= 580" in r.stderr and "12.8/12.9" in r.stderr, r.stderr
    assert "Nothing was downloaded" in r.stderr


def test_exclusive_process_fails_naming_default(tmp_path):
    # GPU 1 only: every GPU counts, not the first
    r, _ = run_script(tmp_path, [f"0, 580.65.06, Default, {H100}",
                                 f"1, 580.65.06, Exclusive_Process, {H100}"])
    assert r.returncode == 1, r.stdout + r.stderr
    assert "compute mode Default: GPU 1 is Exclusive_Process;" in r.stderr, r.stderr
    assert "GPU 0 is" not in r.stderr


def test_driver_580_default_passes_and_downloads_nothing(tmp_path):
    r, python_ran = run_script(tmp_path, [f"{i}, 580.65.06, Default, {H100}" for i in range(8)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU check passed: 8 GPU(s), driver >= 580, compute mode Default" in r.stdout
    assert f"GPU 7: {H100}, driver 580.65.06, compute mode Default" in r.stdout
    assert not python_ran  # --check-only stops before the venv
    # newer drivers pass too (the major version is compared as a number: 1000 > 580)
    r, _ = run_script(tmp_path, [f"0, 1000.1, Default, {H100}"])
    assert r.returncode == 0, r.stderr


def test_no_nvidia_smi_fails_clearly(tmp_path):
    r, _ = run_script(tmp_path, None)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "no nvidia-smi on PATH" in r.stderr and "SKIP_GPU_CHECK=1" in r.stderr, r.stderr


def test_failing_nvidia_smi_is_quoted(tmp_path):
    msg = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
           "Make sure that the latest NVIDIA driver is installed and running.")
    r, _ = run_script(tmp_path, [msg], smi_rc=9)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"nvidia-smi failed, so the NVIDIA driver cannot be checked: {msg}" in r.stderr


def test_install_checks_before_the_venv(tmp_path):
    """Without --check-only: an old driver stops the install before Python is run (the venv,
    pip and every download come after); SKIP_GPU_CHECK=1 goes on to Python (the fake fails
    there, which is where a real install would start)."""
    venv = tmp_path / "venv"
    r, python_ran = run_script(tmp_path, [f"0, 570.86.10, Default, {H100}"], args=(str(venv),))
    assert r.returncode == 1 and "driver 570.86.10 is too old" in r.stderr, r.stderr
    assert not python_ran and not venv.exists()
    r, python_ran = run_script(tmp_path, [f"0, 570.86.10, Default, {H100}"], args=(str(venv),),
                               env={"SKIP_GPU_CHECK": "1"})
    assert "SKIP_GPU_CHECK is set" in r.stderr and python_ran, r.stderr


# --------------------------------------------------------------------------------------------
# the smoke command


def test_smoke_without_vllm_says_so():
    """This environment (CPU torch, faiss-cpu, no vLLM): what each sees, and the missing one."""
    r = subprocess.run([sys.executable, str(SMOKE)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "cuda available False, 0 GPU(s)" in r.stdout and "faiss 1.15.1: 0 GPU(s)" in r.stdout
    assert "vllm does not import: ModuleNotFoundError" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_STAMP.exists(),
                    reason="no finished .venv-vllm (bash scripts/setup_vllm_cpu.sh)")
def test_smoke_in_the_cpu_vllm_environment():
    """All three import in one process; --require-gpu names each library that sees no GPU."""
    r = subprocess.run([str(VLLM_PY), str(SMOKE), "--require-gpu"], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "vllm 0.32.0: platform cpu" in r.stdout, r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("gpu_smoke: ")]
    assert [e.split(":")[1].split()[0] for e in errors] == ["torch", "faiss", "vllm's"], errors


@pytest.mark.gpu
def test_smoke_on_a_gpu():
    """On a GPU node, in the environment setup_gpu_env.sh made: everything sees the GPU."""
    r = subprocess.run([sys.executable, str(SMOKE), "--require-gpu"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
