"""Locations of the shared parity goldens (``../shared/parity`` beside the repository)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def parity_dir() -> Path:
    """``$NEMO_FACTUALITY_PARITY`` or ``<repo>/../shared/parity``; raises naming the path if missing."""
    path = Path(os.environ.get("NEMO_FACTUALITY_PARITY", REPO_ROOT / ".." / "shared" / "parity")).resolve()
    if not path.is_dir():
        raise FileNotFoundError(
            f"Parity goldens not found at {path}. Clone the repository next to 'shared/' "
            f"or set NEMO_FACTUALITY_PARITY to the folder holding safe_f1_at_k.json etc."
        )
    return path


def load_parity(name: str) -> dict[str, Any]:
    """Load ``<parity_dir>/<name>`` (e.g. ``"safe_f1_at_k.json"``)."""
    return json.loads((parity_dir() / name).read_text(encoding="utf-8"))
