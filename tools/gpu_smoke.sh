#!/usr/bin/env bash
# GPU smoke kit (README "GPU smoke kit"): a backend's GRPO stage on one NVIDIA GPU, TRL's GRPOTrainer beside it.
#
#   bash tools/gpu_smoke.sh [--backend aligner|megatron] [--out DIR] [--steps N] [--skip-trl]
#                                                          # a Linux machine with one GPU and PyTorch, no network:
#                                                          # installs the wheels carried in $NF_SMOKE_WHEELS (.whl)
#   bash tools/gpu_smoke.sh --download DIR [--backend megatron]   # on a machine with PyPI: fetch those wheels into DIR
#   bash tools/gpu_smoke.sh --cpu [--backend megatron] [--out DIR] # the CPU path (tiny model) in the backend's venv
#   bash tools/gpu_smoke.sh --install-only [--backend megatron]    # only the offline install (CI: Python 3.12)
#   ... --async --vllm-python PY   # also async GRPO (grpo.max_staleness 0 and 1) on a vLLM engine in PY (not carried)
#
# requirements/gpu_smoke.txt lists what the aligner backend (NeMo, Megatron-Core 0.12, NeMo-Aligner) and the TRL peer
# carry, installed into $NF_SMOKE_SITE; requirements/gpu_smoke_megatron.txt what the megatron backend (Megatron-Core
# 0.16.1, Megatron-Bridge 0.3.1, transformers 4.57) carries, in $DIR/megatron and its own folder
# ($NF_SMOKE_SITE-megatron): the two stacks pin different transformers and Megatron-Core, so each phase's process sees
# one of them. Transformer Engine and Apex are CUDA builds that cannot be carried: Megatron-Core's local layer spec,
# nemo_factuality.testing.apex_free (aligner) and testing.megatron_cpu's import-time TE stand-in (megatron) stand in.
set -euo pipefail
for arg in "$@"; do  # the comment block above is the usage; it needs nothing installed
  case $arg in -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;; esac
done
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
wheels=${NF_SMOKE_WHEELS:-.whl}
site=${NF_SMOKE_SITE:-/tmp/nf_smoke_site}
backend=aligner skip_trl=0 cpu=0 install_only=0 prev=""
for arg in "$@"; do
  [ "$prev" = --backend ] && backend=$arg
  case $arg in --skip-trl) skip_trl=1 ;; --cpu) cpu=1 ;; --install-only) install_only=1 ;; esac
  prev=$arg
done
case $backend in aligner | megatron) ;; *) echo "gpu_smoke: --backend $backend: use aligner or megatron" >&2; exit 2 ;; esac
pins() { grep -vE '^\s*(#|$)' "$1" | sed 's/\s*#.*//'; }
# (requirements file, wheel folder, install folder) for each stack this run needs; the aligner stack is the TRL peer's
stacks=()
[ $backend = aligner ] || [ $skip_trl = 0 ] && stacks+=("requirements/gpu_smoke.txt $wheels $site")
[ $backend = megatron ] && stacks+=("requirements/gpu_smoke_megatron.txt $wheels/megatron $site-megatron")

if [ "${1:-}" = --download ]; then
  dest=${2:?usage: $0 --download DIR [--backend megatron]}
  lists=("requirements/gpu_smoke.txt $dest")  # the megatron backend's run needs it too: the TRL peer's stack
  [ $backend = megatron ] && lists+=("requirements/gpu_smoke_megatron.txt $dest/megatron")
  for stack in "${lists[@]}"; do
    read -r list into <<<"$stack"
    mkdir -p "$into"
    # cp312 manylinux wheels for the GPU machine's Python 3.12; where a release has none for 3.12 (megatron-core
    # 0.12.3 has cp310/cp311 only, antlr4-python3-runtime 4.9.3 no wheel at all) its sdist, built there
    while read -r pin; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
          --platform any -d "$into" "$pin" 2>/dev/null \
        || python3 -m pip download -q --no-deps --no-binary=:all: -d "$into" "$pin"
    done < <(pins "$list")
  done
  du -sh "$dest"
  exit 0
fi

if [ $cpu = 1 ]; then
  if [ $backend = megatron ]; then
    venv=${NEMO_FACTUALITY_MEGATRON_VENV:-$(bash tools/setup_stack_env.sh megatron | tail -n 1)}
    if [ $skip_trl = 0 ]; then  # the peer runs where TRL is: the aligner venv
      peer=${NEMO_FACTUALITY_ALIGNER_VENV:-$(bash tools/setup_stack_env.sh aligner --path)}
      [ -f "$peer/.complete" ] || { echo "gpu_smoke: the TRL peer runs in the aligner venv ($peer), not built: build it" \
        "with tools/setup_stack_env.sh aligner or pass --skip-trl" >&2; exit 2; }
      export NF_SMOKE_TRL_PYTHON="$peer/bin/python"
    fi
  else
    venv=${NEMO_FACTUALITY_ALIGNER_VENV:-$(bash tools/setup_stack_env.sh aligner | tail -n 1)}
  fi
  # the hf backend's phase needs transformers >= 4.56 (neither stack's pin): the project's own venv
  hf_python=$PWD/.venv/bin/python
  [ -x "$hf_python" ] || hf_python=$(command -v python3)
  export NF_SMOKE_HF_PYTHON=${NF_SMOKE_HF_PYTHON:-$hf_python} NF_SMOKE_HF_PYTHONPATH="$PWD"
  # the async phase (--async) is the hf backend's too
  export NF_SMOKE_ASYNC_PYTHON=${NF_SMOKE_ASYNC_PYTHON:-$hf_python} NF_SMOKE_ASYNC_PYTHONPATH="$PWD"
  exec env PYTHONPATH="$PWD" OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 \
    "$venv/bin/python" tools/gpu_smoke.py "$@"
fi

if [ $install_only = 0 ]; then
  python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" 2>/dev/null || {
    if python3 -c "import torch" 2>/dev/null; then
      echo "gpu_smoke: PyTorch sees no GPU here; run with --cpu for the CPU path" >&2
    else
      echo "gpu_smoke: $(command -v python3) has no PyTorch: run the kit with the GPU machine's Python (or --cpu for" \
        "the CPU path, which brings its own venv)" >&2
    fi
    exit 2; }
fi
missing=()
for stack in "${stacks[@]}"; do
  read -r list from _ <<<"$stack"
  while read -r pin; do
    name=${pin%%==*}; name=${name%%[*}; file=$(echo "$name" | tr '-' '_')
    compgen -G "$from/${file}-*" >/dev/null || compgen -G "$from/${name}-*" >/dev/null || missing+=("$from: $pin")
  done < <(pins "$list")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_smoke: not carried: ${missing[*]} — fetch them with: bash tools/gpu_smoke.sh --download $wheels" \
    "--backend $backend" >&2
  exit 2
fi
# megatron-core's sdist (no cp312 wheel) runs `python3 -m pybind11` from PATH while it builds its C++ helper: make
# that the interpreter installing it, the one whose pybind11/setuptools --no-build-isolation uses
python_dir=$(dirname "$(python3 -c 'import sys; print(sys.executable)')")
export PATH="$python_dir:$PATH"
shopt -s nullglob
for stack in "${stacks[@]}"; do
  read -r list from into <<<"$stack"
  echo "== installing $(find "$from" -maxdepth 1 -type f | wc -l) carried packages ($list) into $into" >&2
  rm -rf "$into"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --no-build-isolation --target "$into" \
    "$from"/*.whl "$from"/*.tar.gz "$from"/*.zip
done
[ $install_only = 1 ] && { echo "== installed" >&2; exit 0; }
# the megatron phase's process sees the megatron stack only; the parent (model build) and the TRL peer the aligner's
[ $backend = megatron ] && export NF_SMOKE_MEGATRON_PYTHONPATH="$site-megatron:$PWD"
# the hf backend's phase: the machine's own torch and transformers 5 (the carried stacks pin older transformers);
# the async phase (--async: the hf backend on a vLLM engine, --vllm-python) alike
export NF_SMOKE_HF_PYTHONPATH="$PWD" NF_SMOKE_ASYNC_PYTHONPATH="$PWD"
if [ $backend = megatron ] && [ $skip_trl = 1 ]; then
  export PYTHONPATH="$site-megatron:$PWD"
else
  export PYTHONPATH="$site:$PWD"
fi
exec python3 tools/gpu_smoke.py "$@"
