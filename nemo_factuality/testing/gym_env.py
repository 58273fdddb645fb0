"""Find the NeMo-Gym venv (``tools/setup_stack_env.sh gym``: nemo-gym 0.4.0 on Python 3.12, no torch, from its lock) for
the tests in which NeMo-Gym's own client, runner and rollout collection call the project's resources server. They run
there as their own processes; the test process only needs the interpreter's path. Importing this module imports
nothing heavy."""

from __future__ import annotations

from pathlib import Path

from nemo_factuality.testing.venvs import built_venv

STACK = "gym"  # tools/setup_stack_env.sh builds its venv
ENV_VAR = "NEMO_FACTUALITY_GYM_VENV"


def gym_venv() -> Path | None:
    """``$NEMO_FACTUALITY_GYM_VENV`` or where the setup script builds it; None when not built."""
    return built_venv(ENV_VAR, STACK)


def skip_reason() -> str:
    return (f"the NeMo-Gym venv is not built: run `bash tools/setup_stack_env.sh {STACK}` (about half a minute with "
            f"uv, 1.2 GB) or point ${ENV_VAR} at one")
