#!/usr/bin/env bash
# Build (when missing) and print the path of the NeMo-Aligner 0.7.0 venv the aligner backend's tests
# run in. The venv lives outside the checkout, keyed by the hash of its pinned requirements, so CI and
# every worktree share one build (~8 min on 2 shared cores, ~3 GB) and a requirements change builds a
# new one. The checkout itself is not installed into it: callers put the checkout on PYTHONPATH, so one
# venv serves any checkout without going stale.
#
#   tools/setup_aligner_env.sh            # build if missing; prints the venv path on the last line
#   tools/setup_aligner_env.sh --path     # only print where it is (or would be); builds nothing
#   ALIGNER_VENV_ROOT=/some/dir tools/setup_aligner_env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
key=$(cat requirements/aligner.txt requirements/aligner-constraints.txt requirements/aligner-test.txt | sha256sum | cut -c1-12)
root=${ALIGNER_VENV_ROOT:-$HOME/.cache/nemo_factuality}
venv="$root/aligner-venv-$key"
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
exec 9>"$root/.aligner-venv-$key.lock"
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
step() { echo "[$1/4 after $(( $(date +%s) - start )) s] $2" >&2; }
echo "building the NeMo-Aligner venv in $venv (about 8 min)" >&2
"$PY" -m venv "$build"
# Low priority on a shared machine; the test command raises it when the build runs beside the tests it gates.
niceness=${NEMO_FACTUALITY_BUILD_NICE:-19}
# --no-compile: pip byte-compiles every module it installs (torch alone: about 2 min of a shared core); Python
# compiles the few the tests import, once, on first import
pip=("$build/bin/python" -m pip install -q --progress-bar off --no-compile)
# The CPU torch first; the constraints keep it (nemo's extras would pull a CUDA torch 2.14 otherwise).
step 1 "torch 2.13.0 (CPU)"
nice -n "$niceness" "${pip[@]}" torch==2.13.0
step 2 "nemo-toolkit, nemo-aligner, megatron-core and their pins (the long step)"
nice -n "$niceness" "${pip[@]}" -c requirements/aligner-constraints.txt -r requirements/aligner.txt -r requirements/aligner-test.txt
# Whatever the resolver did, the CPU torch is what runs (a no-op when it was kept).
step 3 "keeping the CPU torch"
nice -n "$niceness" "${pip[@]}" --no-deps torch==2.13.0
# torchvision (pulled by nvidia-modelopt) is a CUDA build whose ops do not register on the CPU torch, and
# torchmetrics imports it when present; nothing NeMo's GPT/Aligner path uses needs it.
"$build/bin/python" -m pip uninstall -q -y torchvision
step 4 "checking that torch, nemo, nemo_aligner, megatron.core, pytriton and trl import"
"$build/bin/python" - <<'EOF'
import torch, nemo, nemo_aligner, megatron.core, pytriton, trl  # noqa: F401  (the build is usable)
assert not torch.cuda.is_available() and "+cpu" in torch.__version__, torch.__version__
EOF
touch "$build/.complete"
# venvs hard-code their own path in scripts: rebuild the entry points by moving, then fixing shebangs.
rm -rf "$venv"
mv "$build" "$venv"
trap - EXIT
grep -rlI --exclude-dir=__pycache__ "$build" "$venv/bin" | xargs -r sed -i "s|$build|$venv|g"
echo "NeMo-Aligner venv built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
echo "$venv"
