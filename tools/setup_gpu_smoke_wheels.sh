#!/usr/bin/env bash
# The GPU smoke kit's carried wheels (requirements/gpu_smoke.txt, and requirements/gpu_smoke_megatron.txt in
# WHEELS/megatron: `gpu_smoke.sh --download DIR --backend megatron`) and a Python 3.12 venv shaped like the GPU
# machine: its build tools (setuptools, wheel, pybind11: what megatron-core 0.12's sdist build uses there with
# --no-build-isolation), numpy 2, and the packages the megatron stack takes from the machine rather than carries
# (gpu_smoke_megatron.txt's header), at the index's current versions; no torch (see the tests). For
# tests/trainers/test_gpu_smoke_install.py and test_gpu_smoke_megatron.py. Cached under ~/.cache/nemo_factuality keyed
# by both requirements files and this script; prints "WHEELS VENV" on the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
key=$(cat requirements/gpu_smoke.txt requirements/gpu_smoke_megatron.txt tools/setup_gpu_smoke_wheels.sh | sha256sum | cut -c1-12)
root=${ALIGNER_VENV_ROOT:-$HOME/.cache/nemo_factuality}
wheels="$root/gpu-smoke-wheels-$key" venv="$root/gpu-smoke-py312-$key"
if [ ! -f "$wheels/.complete" ]; then
  echo "== fetching the GPU smoke kit's wheels into $wheels (about 1 min, 41 MB)" >&2
  rm -rf "$wheels" && mkdir -p "$wheels"
  bash tools/gpu_smoke.sh --download "$wheels" --backend megatron >&2
  touch "$wheels/.complete"
fi
if [ ! -f "$venv/.complete" ]; then
  python=""
  # pyenv's installs first (its python3.12 shim fails unless that version is selected), then the PATH
  for candidate in "$(command -v python3.12 || true)" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      python=$candidate
    fi
  done
  [ -n "$python" ] || { echo "no Python 3.12 found (pyenv's versions/3.12.* or python3.12 on PATH)" >&2; exit 3; }
  echo "== building the GPU-machine-shaped Python 3.12 venv in $venv" >&2
  rm -rf "$venv" && "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --progress-bar off setuptools wheel pybind11 "numpy>=2" >&2
  # what the GPU machine has and the megatron stack imports from it (KINDS.md's package list)
  "$venv/bin/python" -m pip install -q --progress-bar off einops rich psutil packaging tqdm pyyaml regex requests \
    safetensors hf-xet filelock fsspec typing_extensions jinja2 >&2
  touch "$venv/.complete"
fi
echo "$wheels $venv"
