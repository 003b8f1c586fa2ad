#!/usr/bin/env bash
# GPU smoke check, run on a lent GPU machine from the repo root (python3 there holds a CUDA
# torch and transformers). Prints the device, then runs the tests marked `gpu`.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY'
import torch, transformers
print(f"torch {torch.__version__} cuda {torch.version.cuda} transformers {transformers.__version__}")
print(f"device: {torch.cuda.get_device_name(0)}, bf16 supported: {torch.cuda.is_bf16_supported()}")
PY
# only the modules that hold GPU tests: the GPU image lacks some CPU-side dependencies
files=$(grep -rl "mark.gpu" tests --include='test_*.py')
python3 -m pytest -q -p no:cacheprovider -m gpu $files "$@"
rc=$?
# Qwen3-4B-sized numbers (random weights built from the config; nothing is downloaded)
python3 bench/gpu_bench.py || rc=1
# one RL step of a Qwen3-0.6B-architecture model through the trainer's functions
python3 bench/gpu_rl_step.py || rc=1
# the memory planner's pass terms against torch.cuda.max_memory_allocated
python3 bench/plan_memory.py --device cuda || rc=1
exit $rc
