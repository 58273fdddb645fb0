#!/usr/bin/env bash
# GPU smoke kit (README "GPU smoke kit"): the aligner backend's GRPO stage on one NVIDIA GPU, TRL's GRPOTrainer beside it.
#
#   bash tools/gpu_smoke.sh [--out DIR] [--steps N]       # a Linux machine with one GPU and PyTorch, no network:
#                                                          # installs the wheels carried in $NF_SMOKE_WHEELS (.whl)
#   bash tools/gpu_smoke.sh --download DIR                # on a machine with PyPI: fetch those wheels into DIR
#   bash tools/gpu_smoke.sh --cpu [--out DIR]             # the CPU path (tiny model) in the NeMo-Aligner venv; CI runs it
#   bash tools/gpu_smoke.sh --install-only                # only the offline install of the carried wheels (CI: Python 3.12)
#
# requirements/gpu_smoke.txt lists what is carried: NeMo, Megatron-Core, NeMo-Aligner and what they import that a
# bare PyTorch machine lacks, at the versions CI tests (Transformer Engine and Apex are CUDA builds that cannot be
# carried: Megatron-Core's local layer spec and nemo_factuality.testing.apex_free stand in).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
wheels=${NF_SMOKE_WHEELS:-.whl}
site=${NF_SMOKE_SITE:-/tmp/nf_smoke_site}
list=requirements/gpu_smoke.txt
pins() { grep -vE '^\s*(#|$)' "$list" | sed 's/\s*#.*//'; }

if [ "${1:-}" = --download ]; then
  dest=${2:?usage: $0 --download DIR}
  mkdir -p "$dest"
  # cp312 manylinux wheels for the GPU machine's Python 3.12; where a release has none for 3.12 (megatron-core
  # 0.12.3 has cp310/cp311 only, antlr4-python3-runtime 4.9.3 no wheel at all) its sdist, built there
  while read -r pin; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$dest" "$pin" 2>/dev/null \
      || python3 -m pip download -q --no-deps --no-binary=:all: -d "$dest" "$pin"
  done < <(pins)
  du -sh "$dest"
  exit 0
fi

for arg in "$@"; do
  if [ "$arg" = --cpu ]; then
    venv=${NEMO_FACTUALITY_ALIGNER_VENV:-$(bash tools/setup_aligner_env.sh | tail -n 1)}
    exec env PYTHONPATH="$PWD" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 \
      "$venv/bin/python" tools/gpu_smoke.py "$@"
  fi
done

install_only=0
for arg in "$@"; do [ "$arg" = --install-only ] && install_only=1; done
if [ $install_only = 0 ]; then
  python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || {
    echo "gpu_smoke: PyTorch sees no GPU here; run with --cpu for the CPU path" >&2; exit 2; }
fi
missing=()
while read -r pin; do
  name=${pin%%==*}; name=${name%%[*}; file=$(echo "$name" | tr '-' '_')
  compgen -G "$wheels/${file}-*" >/dev/null || compgen -G "$wheels/${name}-*" >/dev/null || missing+=("$pin")
done < <(pins)
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_smoke: not in $wheels: ${missing[*]} — fetch them with: bash tools/gpu_smoke.sh --download $wheels" >&2
  exit 2
fi
echo "== installing $(find "$wheels" -maxdepth 1 -type f | wc -l) carried packages into $site" >&2
# megatron-core's sdist (no cp312 wheel) runs `python3 -m pybind11` from PATH while it builds its C++ helper: make
# that the interpreter installing it, the one whose pybind11/setuptools --no-build-isolation uses
python_dir=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
export PATH="$python_dir:$PATH"
rm -rf "$site"
shopt -s nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --target "$site" \
  "$wheels"/*.whl "$wheels"/*.tar.gz "$wheels"/*.zip
[ $install_only = 1 ] && { echo "== installed into $site" >&2; exit 0; }
export PYTHONPATH="$site:$PWD"
exec python3 tools/gpu_smoke.py "$@"
