"""Locations of the parity goldens (``tests/data/parity`` in the repository, a copy of the project's shared ones)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def parity_dir() -> Path:
    """``$NEMO_FACTUALITY_PARITY`` or ``<repo>/tests/data/parity``; raises naming the path if missing."""
    path = Path(os.environ.get("NEMO_FACTUALITY_PARITY", REPO_ROOT / "tests" / "data" / "parity")).resolve()
    if not path.is_dir():
        raise FileNotFoundError(
            f"Parity goldens not found at {path}: they are part of the repository (tests/data/parity); "
            f"restore that folder or set NEMO_FACTUALITY_PARITY to a folder holding safe_f1_at_k.json etc."
        )
    return path


def load_parity(name: str) -> dict[str, Any]:
    """Load ``<parity_dir>/<name>`` (e.g. ``"safe_f1_at_k.json"``)."""
    return json.loads((parity_dir() / name).read_text(encoding="utf-8"))
