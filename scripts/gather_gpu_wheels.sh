#!/usr/bin/env bash
# Gather the wheels bench/gpu_check.sh installs on the lent single-GPU check machine, which has
# Python 3.12 with a CUDA torch and transformers and nothing else, and cannot download.
#   bash scripts/gather_gpu_wheels.sh            # -> .gpu-wheels/ (gitignored), cp312
#   PYVER=3.11 bash scripts/gather_gpu_wheels.sh # wheels for another Python (local check)
# DeepSpeed (the version requirements/common.txt pins) ships only as a source archive; it is
# built here into a pure-Python wheel (DS_BUILD_OPS=0: its ops compile just in time where
# used, and the trainer uses none). The rest are pinned to the main environment's versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
OUT=${OUT:-.gpu-wheels}
PIP=(.venv/bin/pip)
[[ -x ${PIP[0]} ]] || { echo "gather_gpu_wheels: run ./run true first (needs .venv's pip)" >&2; exit 1; }
pin() { grep -E "^$1==" requirements/*.txt | head -1 | cut -d: -f2; }
ds=$(pin deepspeed)
[[ -n $ds ]] || { echo "gather_gpu_wheels: no deepspeed pin in requirements/" >&2; exit 1; }
rm -rf "$OUT" && mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PIP[@]}" download -q --no-deps --no-binary :all: -d "$tmp" "$ds"
DS_BUILD_OPS=0 "${PIP[@]}" wheel -q --no-deps --no-build-isolation -w "$OUT" "$tmp"/deepspeed-*.tar.gz
# DeepSpeed's and pytest's requirements (not torch, numpy, packaging, tqdm: the machine has them)
frozen=$("${PIP[@]}" freeze 2>/dev/null)
want=()
for name in einops hjson msgpack ninja psutil py-cpuinfo pydantic pydantic_core \
            annotated-types typing-inspection typing_extensions pytest pluggy iniconfig \
            pygments; do
  line=$(grep -iE "^${name//[-_]/[-_]}==" <<<"$frozen" || true)
  [[ -n $line ]] || { echo "gather_gpu_wheels: $name is not in .venv" >&2; exit 1; }
  want+=("$line")
done
"${PIP[@]}" download -q --no-deps --only-binary :all: -d "$OUT" --python-version "$PYVER" \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  --implementation cp "${want[@]}"
size=$(du -sm "$OUT" | cut -f1)
echo "gather_gpu_wheels: $(ls "$OUT" | wc -l) wheels for Python $PYVER in $OUT ($size MB)"
(( size <= 20 )) || { echo "gather_gpu_wheels: $size MB is over the 20 MB the check carries" >&2; exit 1; }
