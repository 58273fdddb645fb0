#!/usr/bin/env bash
# Where a CPU-only machine gets torch's CPU build: prints installer arguments.
#
#   tools/torch_index.sh --pip-args     # for pip: e.g. "--extra-index-url https://download.pytorch.org/whl/cpu"
#   tools/torch_index.sh --uv-args      # for uv: the same after pip's configured sources (uv does not read pip's)
#   tools/torch_index.sh --describe     # one line saying which source was chosen and why
#
# --pip-args and --uv-args also write the --describe line on stderr, prefixed "torch: " (the probe is made once).
#
# On PyPI, torch 2.13.0 for Linux is the CUDA build (several GB of nvidia-* wheels). PyTorch's CPU index holds
# 2.13.0+cpu, which sorts above 2.13.0, so an installer that looks at both takes the CPU build. The sources, in order:
#   * the folders and indexes pip is configured with (PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL, or `pip config`): a
#     machine with a local wheel mirror uses it, and uv (which does not read pip's configuration) gets the same;
#   * PyTorch's CPU index ($NEMO_FACTUALITY_TORCH_INDEX, default https://download.pytorch.org/whl/cpu), when it
#     answers within 10 s; when it does not (an air-gapped or PyPI-only network) it is left out rather than failing
#     the install, and --describe says so: torch then comes from the sources above, or PyPI's CUDA build.
# A machine with an NVIDIA GPU (nvidia-smi lists one) gets no CPU index: its torch is the CUDA build, as usual.
# NEMO_FACTUALITY_TORCH=cpu|cuda overrides the detection.
set -euo pipefail
case "${1:-}" in
  --pip-args | --uv-args | --describe) ;;
  *) echo "usage: tools/torch_index.sh --pip-args|--uv-args|--describe" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
index=${NEMO_FACTUALITY_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

pip_setting() {  # $1: the env variable, $2: the pip config key; whitespace-separated values
  local value=${!1:-}
  [ -n "$value" ] || value=$("$PY" -m pip config get "global.$2" 2>/dev/null || true)
  echo "$value"
}

want=${NEMO_FACTUALITY_TORCH:-}
if [ -z "$want" ]; then
  want=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then want=cuda; fi
fi
args=()
# pip reads its own configuration; uv does not, so --uv-args hands it over
[ "$1" = --uv-args ] && for link in $(pip_setting PIP_FIND_LINKS find-links); do
  [ -e "${link#file://}" ] || [[ $link == http* ]] && args+=(--find-links "$link")
done
[ "$1" = --uv-args ] && for url in $(pip_setting PIP_EXTRA_INDEX_URL extra-index-url); do args+=(--extra-index-url "$url"); done
why="this machine has an NVIDIA GPU: torch's CUDA build from the default index"
if [ "$want" = cpu ]; then
  if command -v curl >/dev/null && curl -fsS --max-time 10 -o /dev/null "$index/torch/" 2>/dev/null; then
    args+=(--extra-index-url "$index")
    why="no GPU: torch's CPU build from $index"
  else
    why="no GPU, but $index did not answer: torch's CPU build only if a configured wheel folder or index has it (else PyPI's CUDA build)"
  fi
fi
if [ "$1" != --describe ]; then
  echo "torch: $why" >&2  # the one probe's answer said once, so a caller need not probe again to tell the user
  echo "${args[*]}"
else
  echo "$why"
fi
