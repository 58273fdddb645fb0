"""JSONL reading with errors that name ``file:line`` (shared by eval, the knowledge store and builders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from nemo_factuality.types import FactualityInputError


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", record)`` for each non-blank line; bad UTF-8, bad JSON or non-objects raise."""
    path = Path(path)
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise FactualityInputError(f"{where}: invalid UTF-8 at byte {err.start}; re-encode the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as err:
                raise FactualityInputError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(obj, dict):
                raise FactualityInputError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
            yield where, obj
