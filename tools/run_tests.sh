#!/usr/bin/env bash
# The project's test command (README): the whole suite, bounded in time, CPU only.
#
#   bash tools/run_tests.sh                      # everything, the NeMo-Aligner backend's tests included
#   bash tools/run_tests.sh tests/evaluation     # one directory (or file, or -k ...)
#   NEMO_FACTUALITY_SKIP_ALIGNER=1 bash tools/run_tests.sh   # no aligner venv build; those tests skip
#   NEMO_FACTUALITY_SKIP_MEGATRON=1 bash tools/run_tests.sh  # no megatron venv build; those tests skip
#
# The aligner backend's tests run in their own venv (NeMo-Aligner 0.7.0 stack). When the run includes them
# and $NEMO_FACTUALITY_ALIGNER_VENV is not set, tools/setup_aligner_env.sh finds it or builds it first
# (~8 min and ~3 GB once, then cached outside the checkout and shared by every checkout).
# The megatron backend's tests likewise run in theirs (Megatron-Core 0.16.1 + Megatron-Bridge 0.3.1):
# $NEMO_FACTUALITY_MEGATRON_VENV, else tools/setup_megatron_env.sh finds or builds it (~1 min, ~1.2 GB once).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false

# Does this run collect tests that use the aligner venv? The whole suite does; named paths do when a test
# file in them imports testing.aligner_env or takes the `venv` fixture.
runs_aligner_tests() {
  local paths=() arg
  for arg in "$@"; do
    [[ $arg == -* ]] && continue
    [ -e "${arg%%::*}" ] && paths+=("${arg%%::*}")
  done
  [ ${#paths[@]} -eq 0 ] && return 0
  grep -rqlE 'aligner_env|[(, ]venv[,)]' --include='*.py' "${paths[@]}"
}

# The same for the megatron venv: test files that import testing.megatron_env or take the `megatron_venv` fixture.
runs_megatron_tests() {
  local paths=() arg
  for arg in "$@"; do
    [[ $arg == -* ]] && continue
    [ -e "${arg%%::*}" ] && paths+=("${arg%%::*}")
  done
  [ ${#paths[@]} -eq 0 ] && return 0
  grep -rqlE 'megatron_env|[(, ]megatron_venv[,)]' --include='*.py' "${paths[@]}"
}

if [ -z "${NEMO_FACTUALITY_ALIGNER_VENV:-}" ] && [ "${NEMO_FACTUALITY_SKIP_ALIGNER:-0}" != 1 ] \
    && runs_aligner_tests "$@"; then
  if [ ! -f "$(bash tools/setup_aligner_env.sh --path)/.complete" ]; then
    echo "== the NeMo-Aligner venv is missing: building it for the aligner backend's tests" \
         "(NEMO_FACTUALITY_SKIP_ALIGNER=1 skips the build and those tests)" >&2
  fi
  NEMO_FACTUALITY_ALIGNER_VENV=$(bash tools/setup_aligner_env.sh | tail -n 1)
  export NEMO_FACTUALITY_ALIGNER_VENV
  echo "== NeMo-Aligner venv: $NEMO_FACTUALITY_ALIGNER_VENV" >&2
fi
if [ -z "${NEMO_FACTUALITY_MEGATRON_VENV:-}" ] && [ "${NEMO_FACTUALITY_SKIP_MEGATRON:-0}" != 1 ] \
    && runs_megatron_tests "$@"; then
  if [ ! -f "$(bash tools/setup_megatron_env.sh --path)/.complete" ]; then
    echo "== the Megatron-Core/Bridge venv is missing: building it for the megatron backend's tests" \
         "(NEMO_FACTUALITY_SKIP_MEGATRON=1 skips the build and those tests)" >&2
  fi
  NEMO_FACTUALITY_MEGATRON_VENV=$(bash tools/setup_megatron_env.sh | tail -n 1)
  export NEMO_FACTUALITY_MEGATRON_VENV
  echo "== Megatron-Core/Bridge venv: $NEMO_FACTUALITY_MEGATRON_VENV" >&2
fi
exec python -m pytest -q -ra --timeout=600 "$@"
