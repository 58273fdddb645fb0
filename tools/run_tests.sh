#!/usr/bin/env bash
# The project's test command (README): the whole suite, bounded in time, CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -ra --timeout=600 "$@"
