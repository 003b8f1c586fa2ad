#!/usr/bin/env bash
# Make a GPU node's environment: a CPython 3.11 venv with requirements/gpu.txt's pins (torch 2.14.0,
# a CUDA build; vLLM 0.33.0; faiss-gpu 1.15.1; common.txt), test.txt, and this package editable.
#
#   bash scripts/setup_gpu_env.sh [VENV_DIR]          # default .venv-gpu; idempotent (stamp)
#   FORCE=1 bash scripts/setup_gpu_env.sh [VENV_DIR]  # install again into the existing venv
#   PYTHON=/path/to/python3.11 bash scripts/setup_gpu_env.sh ...
#   DRY_RUN=REPORT_DIR bash scripts/setup_gpu_env.sh VENV_DIR
#       resolve every layer with pip's resolver and write REPORT_DIR/layer{1,2}.json (pip's
#       --report); installs nothing but pip itself into VENV_DIR (tests/test_gpu_lock.py)
#
# Needs: Linux x86_64 with glibc >= 2.28 (torch's and vllm's wheels are manylinux_2_28), an NVIDIA
# driver for CUDA 13 (torch 2.14.0's PyPI wheel is a CUDA 13.0 build; faiss-gpu adds CUDA 12.9
# runtime libraries, which run on that driver too), access to PyPI (or a mirror in pip's config),
# and disk for 5.4 GB of wheels (300 packages; more once unpacked).
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
      ('torch', 'vllm', 'faiss-gpu', 'transformers', 'numpy', 'snakemake-executor-plugin-slurm')))
import torch
print(f'  torch CUDA {torch.version.cuda}; GPU visible here: {torch.cuda.is_available()}')"
step "pip check (expected: mistral-common's numpy<2.4 only):"
pip check | sed 's/^/  /' || true

echo "$want" > "$STAMP"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
