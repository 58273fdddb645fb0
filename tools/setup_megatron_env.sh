#!/usr/bin/env bash
# Build (when missing) and print the path of the Megatron-Core 0.16.1 + Megatron-Bridge 0.3.1 venv the megatron
# backend's tests run in. The venv lives outside the checkout, keyed by the hash of its pinned requirements, so CI and
# every worktree share one build (about a minute on 2 shared cores when the wheels are cached, ~1.5 GB) and a
# requirements change builds a new one. The checkout itself is not installed into it: callers put the checkout on
# PYTHONPATH, so one venv serves any checkout without going stale.
#
#   tools/setup_megatron_env.sh            # build if missing; prints the venv path on the last line
#   tools/setup_megatron_env.sh --path     # only print where it is (or would be); builds nothing
#   MEGATRON_VENV_ROOT=/some/dir tools/setup_megatron_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
key=$(sha256sum requirements/megatron.txt | cut -c1-12)
root=${MEGATRON_VENV_ROOT:-$HOME/.cache/nemo_factuality}
venv="$root/megatron-venv-$key"
if [ "${1:-}" = "--path" ]; then
  echo "$venv"
  exit 0
fi
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi

mkdir -p "$root"
# One build at a time per venv: a second caller (another checkout's test run) waits for it, then reuses it.
exec 9>"$root/.megatron-venv-$key.lock"
if command -v flock >/dev/null && ! flock -n 9; then
  echo "waiting for another build of $venv to finish" >&2
  flock 9
fi
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi
build="$venv.build.$$"
trap 'rm -rf "$build"' EXIT
start=$(date +%s)
step() { echo "[$1/3 after $(( $(date +%s) - start )) s] $2" >&2; }
echo "building the Megatron-Core/Bridge venv in $venv (about a minute)" >&2
"$PY" -m venv "$build"
# Low priority on a shared machine; the test command raises it when the build runs beside the tests it gates.
niceness=${NEMO_FACTUALITY_BUILD_NICE:-19}
# --no-compile: pip byte-compiles every module it installs (torch alone: about 2 min of a shared core); Python
# compiles the few the tests import, once, on first import
pip=("$build/bin/python" -m pip install -q --progress-bar off --no-compile)
step 1 "torch 2.13.0 (CPU)"
nice -n "$niceness" "${pip[@]}" torch==2.13.0
# --no-deps: Bridge's declared dependencies include CUDA-only builds that cannot install here (requirements/megatron.txt
# says which, and why the pinned set is the one the GPT path imports).
step 2 "megatron-core, megatron-bridge, transformers 4.x and what they import (--no-deps)"
nice -n "$niceness" "${pip[@]}" --no-deps -r requirements/megatron.txt
step 3 "checking that torch, megatron.core and megatron.bridge import (Bridge behind the test stubs)"
PYTHONPATH="$PWD" "$build/bin/python" - <<'EOF'
import torch
assert not torch.cuda.is_available() and "+cpu" in torch.__version__, torch.__version__
from nemo_factuality.testing import megatron_cpu

megatron_cpu.apply()
import megatron.core
from megatron.bridge import AutoBridge  # noqa: F401  (the build is usable)
assert megatron.core.__version__ == "0.16.1", megatron.core.__version__
EOF
touch "$build/.complete"
# venvs hard-code their own path in scripts: rebuild the entry points by moving, then fixing shebangs.
rm -rf "$venv"
mv "$build" "$venv"
trap - EXIT
grep -rlI --exclude-dir=__pycache__ "$build" "$venv/bin" | xargs -r sed -i "s|$build|$venv|g"
echo "Megatron-Core/Bridge venv built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
echo "$venv"
