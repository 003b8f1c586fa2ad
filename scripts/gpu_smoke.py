"""Import torch, vLLM and faiss in one process, as a GPU node's jobs hold them, and print what
each sees. The retrieval server holds torch (the e5 encoder) beside faiss-gpu, and each brings
its own CUDA runtime (13.0 with torch 2.14.0, 12.9 with faiss-gpu 1.15.1); the trainer holds
torch beside vLLM. scripts/setup_gpu_env.sh runs it after installing:

    .venv-gpu/bin/python scripts/gpu_smoke.py [--require-gpu]

One line per library. Exits 1 when a library does not import or a small computation on GPU 0
fails (torch first, then faiss, so both runtimes are loaded in the process); with
--require-gpu also when torch or faiss sees no GPU or vLLM's platform is not CUDA."""

from __future__ import annotations

import argparse
import importlib
import sys


def _torch(torch, require_gpu: bool, problems: list[str]) -> None:
    n = torch.cuda.device_count()
    ok = torch.cuda.is_available()
    line = (f"torch {torch.__version__}: CUDA build {torch.version.cuda}, cuda available {ok}, "
            f"{n} GPU(s)")
    if ok:
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        major, minor = torch.cuda.get_device_capability(0)
        line += f" ({', '.join(names)}; capability {major}.{minor})"
        try:
            x = torch.ones(64, 64, device="cuda")
            got = (x @ x).sum().item()
            if got != 64**3:  # 64 x 64 entries, each a sum of 64 ones
                problems.append(f"torch: a matmul on GPU 0 gave {got}, not {64**3}")
        except Exception as e:  # a runtime or kernel-image error is the finding
            problems.append(f"torch: a matmul on GPU 0 failed: {type(e).__name__}: {e}")
    elif require_gpu:
        problems.append("torch sees no CUDA device (torch.cuda.is_available() is False)")
    print(line)


def _faiss(faiss, require_gpu: bool, problems: list[str]) -> None:
    n = faiss.get_num_gpus()
    print(f"faiss {faiss.__version__}: {n} GPU(s)")
    if n:
        try:
            import numpy as np

            res = faiss.StandardGpuResources()
            index = faiss.GpuIndexFlatIP(res, 8)
            xb = np.eye(8, dtype="float32")[:4]
            index.add(xb)
            _, ids = index.search(xb, 1)
            if ids[:, 0].tolist() != [0, 1, 2, 3]:  # each unit vector finds itself
                problems.append(f"faiss: a GPU search gave {ids[:, 0].tolist()}, not [0, 1, 2, 3]")
        except Exception as e:
            problems.append(f"faiss: a search on GPU 0 failed: {type(e).__name__}: {e}")
    elif require_gpu:
        problems.append("faiss sees no GPU (faiss.get_num_gpus() is 0): faiss-cpu is installed "
                        "instead of faiss-gpu, or faiss-gpu's CUDA 12 runtime did not load")


def _vllm(vllm, require_gpu: bool, problems: list[str]) -> None:
    try:
        from vllm.platforms import current_platform

        platform = current_platform.device_type or "none"
    except Exception as e:
        platform = f"unknown ({type(e).__name__}: {e})"
    print(f"vllm {vllm.__version__}: platform {platform}")
    if require_gpu and platform != "cuda":
        problems.append(f"vllm's platform is {platform}, not cuda")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--require-gpu", action="store_true",
                   help="fail when torch or faiss sees no GPU (a GPU node)")
    args = p.parse_args(argv)
    problems: list[str] = []
    mods = {}
    for name in ("torch", "faiss", "vllm"):
        try:
            mods[name] = importlib.import_module(name)
        except Exception as e:  # any failure to import is the finding
            problems.append(f"{name} does not import: {type(e).__name__}: {e}")
    for name, check in (("torch", _torch), ("faiss", _faiss), ("vllm", _vllm)):
        if name in mods:
            check(mods[name], args.require_gpu, problems)
    for problem in problems:
        print(f"gpu_smoke: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
