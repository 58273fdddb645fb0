"""KLCF's offline checklist builder: what the base model already knows, per prompt.

sample base-model responses → extract claims → verify against the knowledge store → keep the
supported claims, deduplicated per prompt → JSONL ``{"prompt", "checklist": [claims...], "n_responses",
"n_failed"}``. A response whose fact-check failed (judge down) contributes nothing and is counted in
``n_failed`` (with the first reason in ``error``); a prompt whose every response failed gets
``"checklist": null`` (no checklist, so KLCF skips its recall term) instead of a silently empty list.

Input JSONL: ``{"prompt": str, "responses": [str, ...]}`` (responses already sampled, e.g. with vLLM),
or pass ``generate=fn(prompts) -> list[list[str]]`` to sample inside.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from nemo_factuality.jsonl import iter_jsonl
from nemo_factuality.knowledge.store import normalize
from nemo_factuality.types import FactualityInputError, Label

log = logging.getLogger(__name__)


def checklist_for(pipeline: Any, prompt: str, responses: Sequence[str], topic: str | None = None,
                  max_items: int | None = None, failures: list[str] | None = None) -> list[str]:
    """Supported, deduplicated claims across ``responses`` to one prompt (first-seen order).

    Responses whose fact-check failed are skipped; their reasons are appended to ``failures`` if given.
    """
    checks = pipeline.check([prompt] * len(responses), list(responses), topics=[topic] * len(responses))
    seen, items = set(), []
    for check in checks:
        if getattr(check, "error", None) is not None:
            if failures is not None:
                failures.append(check.error)
            continue
        by_id = {v.claim_id: v for v in check.verdicts}
        for claim in check.claims:
            key = normalize(claim.text)
            if key and key not in seen and by_id.get(claim.id) is not None and by_id[claim.id].label is Label.SUPPORTED:
                seen.add(key)
                items.append(claim.text)
    return items[:max_items] if max_items else items


def _read(path: Path) -> Iterable[tuple[str, dict]]:
    """``("file:line", record)`` per prompt (``jsonl.iter_jsonl``: bad JSON names its line and column)."""
    for where, obj in iter_jsonl(path):
        if not isinstance(obj.get("prompt"), str):
            raise FactualityInputError(f"{where}: field 'prompt' missing or not a string")
        yield where, obj


def build_checklists(pipeline: Any, input_jsonl: str | Path, output_jsonl: str | Path, *,
                     generate: Callable[[list[str]], list[list[str]]] | None = None, max_items: int | None = None) -> int:
    """Write one checklist per prompt; returns the number of prompts. Output is written atomically."""
    out = Path(output_jsonl)
    tmp = out.with_name(f".{out.name}.tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for where, rec in tqdm(list(_read(Path(input_jsonl))), desc="checklists", unit="prompt"):
            responses = rec.get("responses")
            if responses is None:
                if generate is None:
                    raise FactualityInputError(f"{where}: no 'responses' and no generate function given")
                responses = generate([rec["prompt"]])[0]
            failures: list[str] = []
            items = checklist_for(pipeline, rec["prompt"], responses, rec.get("topic"), max_items, failures)
            row = {"prompt": rec["prompt"], "checklist": items, "n_responses": len(responses), "n_failed": len(failures)}
            if failures:
                row["error"] = failures[0]
                log.warning("%s: %d of %d responses could not be fact-checked: %s", where, len(failures),
                            len(responses), failures[0])
                if len(failures) == len(responses):
                    row["checklist"] = None
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, out)
    log.info("wrote %d checklists to %s", n, out)
    return n
