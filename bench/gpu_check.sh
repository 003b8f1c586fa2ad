#!/usr/bin/env bash
# The GPU check: one prepared command for a lent single-GPU machine (one ~78 GiB H100; Python
# 3.12 with a CUDA torch and transformers, nothing else, no network), run from the repo root
# with the wheels `scripts/gather_gpu_wheels.sh` gathered here carried along (.gpu-wheels/:
# DeepSpeed and its pure-Python requirements, pytest; 8 MB):
#   bash bench/gpu_check.sh          # ~8 minutes at most: every step has a time limit
#   bash bench/gpu_check.sh --tiny   # the same steps on CPU with tiny models (default suite)
# Steps, most important first: the colocation probe (bench/gpu_probe.py: memory at the phase
# boundaries beside an engine-sized second process, the save's peak, bf16 old vs update
# log-probs, the plan beside each peak), the tests marked gpu, the planner's pass terms
# against measured peaks (bench/plan_memory.py), one RL step of a 0.6B model
# (bench/gpu_rl_step.py), Qwen3-4B throughput (bench/gpu_bench.py). Each prints as it goes; a
# step that fails or runs out of time is reported and the next one runs; exit 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
tiny=()
[[ ${1:-} == --tiny ]] && tiny=(--tiny)
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rc=0
# --tiny on a CPU: the same steps' tiny models at CPU speed, on a machine that may be shared
scale=$([[ ${#tiny[@]} == 0 ]] && echo 1 || echo 4)
step() {  # step NAME SECONDS CMD...
  local name=$1 limit=$(($2 * scale)) t0=$SECONDS r
  shift 2
  echo "== $name (time limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@"
  r=$?
  echo "== $name: exit $r after $((SECONDS - t0)) s$([[ $r == 124 ]] && echo ' (time limit)')"
  [[ $r == 0 ]] || rc=1
}

if [[ ${#tiny[@]} == 0 ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader
  # the carried wheels, unpacked next to the machine's own packages (no pip, no network)
  if ! "$PY" -c "import deepspeed, pytest" 2>/dev/null; then
    [[ -d .gpu-wheels ]] || { echo "gpu_check: no .gpu-wheels/ (run scripts/gather_gpu_wheels.sh" \
                                   "where packages can be downloaded, and carry the folder)" >&2; exit 1; }
    site=$(mktemp -d)
    for w in .gpu-wheels/*.whl; do "$PY" -m zipfile -e "$w" "$site" || exit 1; done
    export PYTHONPATH="$PYTHONPATH:$site"
    "$PY" -c "import deepspeed, pytest" || { echo "gpu_check: the carried wheels do not import" >&2; exit 1; }
  fi
fi
"$PY" -c "import torch, transformers, deepspeed, sys; print(f'python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, deepspeed {deepspeed.__version__}, GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}')" 2>&1 | grep -v "accelerator"

step "colocation probe" 210 "$PY" bench/gpu_probe.py "${tiny[@]}"
if [[ ${#tiny[@]} == 0 ]]; then
  files=$(grep -rl "mark.gpu" tests --include='test_*.py')
  step "tests marked gpu" 90 "$PY" -m pytest -q -p no:cacheprovider -m gpu $files
  step "plan terms vs measured peaks" 60 "$PY" bench/plan_memory.py --device cuda --quick
else
  echo "== tests marked gpu, plan_memory --device cuda: GPU only (the default suite runs both on CPU)"
fi
step "one RL step (Qwen3-0.6B)" 60 "$PY" bench/gpu_rl_step.py "${tiny[@]}"
step "Qwen3-4B throughput" 70 "$PY" bench/gpu_bench.py "${tiny[@]}"
exit $rc
