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
python -m pip install -q -U pip
python -m pip install -q torch==2.13.0           # CPU wheel; must come before anything that depends on torch
python -m pip install -q -e ".[all,dev]"

# System packages: Slurm (controller + slurmd + client), munge, shellcheck. Skipped if present.
need=()
for bin in slurmctld slurmd sbatch shellcheck; do command -v "$bin" >/dev/null 2>&1 || need+=("$bin"); done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq slurmctld slurmd slurm-client munge shellcheck >/dev/null
  else
    echo "warning: missing ${need[*]} and cannot apt-get install; Slurm/shellcheck tests will fail" >&2
  fi
fi

# The docs site's toolchain (Sphinx + MyST; tests/docs builds the site with warnings as errors).
python -m pip install -q -e ".[docs]"
