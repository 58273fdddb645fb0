"""JSONL reading with errors that name ``file:line`` (shared by eval, the knowledge store and builders)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nemo_factuality.types import FactualityInputError


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("file:line", record)`` for each non-blank line.

    Raises ``FactualityInputError`` naming the line for bad UTF-8, bad JSON, JSON nested too deeply
    for the parser, integers over Python's digit limit, and lines that are not objects.
    """
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
                # without its line break: the parser's column is then the line's (an unclosed object ends at the
                # end of its own line, not at column 1 of a line after it)
                obj = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as err:  # some messages end in "at" ("Unterminated string starting at")
                at = "" if err.msg.endswith(" at") else " at"
                raise FactualityInputError(f"{where}: invalid JSON ({err.msg}{at} column {err.colno}); each line must "
                                           "be one complete JSON object") from None
            except RecursionError:
                raise FactualityInputError(f"{where}: JSON nested too deeply to read; flatten this record") from None
            except ValueError:  # the only other ValueError json raises: an integer over Python's digit limit
                raise FactualityInputError(f"{where}: a JSON integer has more than {sys.get_int_max_str_digits()} digits; "
                                           "store such numbers as strings") from None
            if not isinstance(obj, dict):
                raise FactualityInputError(f"{where}: each line must be a JSON object, got {type(obj).__name__}")
            yield where, obj
