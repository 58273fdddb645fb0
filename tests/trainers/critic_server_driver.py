"""Runs in the NeMo-Aligner venv: the critic server (``nemo_factuality.trainers.critic_server``) with the test-only
CPU shims applied first; the arguments are the server's own (``--config-name``, ``key=value`` overrides).

    python tests/trainers/critic_server_driver.py trainer.backend=aligner model.restore_from_path=DIR critic.port=N ...
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import aligner_cpu  # noqa: E402

aligner_cpu.apply()

from nemo_factuality.cli import run_command  # noqa: E402
from nemo_factuality.trainers.critic_server import serve  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_command(serve, sys.argv[1:], "critic_server"))
