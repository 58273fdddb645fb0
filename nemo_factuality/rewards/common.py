"""Helpers the method rewards share: running the fact-check pipeline on guarded text, think/answer parsing."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from nemo_factuality.pipeline import FactualityPipeline, build_judge, build_pipeline
from nemo_factuality.rewards.base import GuardConfig, dedup_claims, is_blank, neutralize_injection
from nemo_factuality.types import FactCheck

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def guarded_check(pipeline: FactualityPipeline, guards: GuardConfig, prompts: Sequence[str], completions: Sequence[str],
                  **kwargs: Any) -> tuple[list[FactCheck | None], list[int]]:
    """Fact-check non-blank completions after neutralising judge injections.

    Returns one ``FactCheck`` per completion (``None`` for blank ones) and the injection hit counts.
    Neutralised text has the same length as the original, so every span still indexes the completion.
    """
    texts, hits = [], []
    for c in completions:
        t, h = neutralize_injection(c)  # hits are counted either way (injection_penalty)
        texts.append(t if guards.neutralize_injection else c)
        hits.append(h)
    live = [i for i, c in enumerate(completions) if not is_blank(c)]
    checks: list[FactCheck | None] = [None] * len(completions)
    if live:
        sub_kwargs = {k: [v[i] for i in live] if v is not None else None for k, v in kwargs.items()}
        results = pipeline.check([prompts[i] for i in live], [texts[i] for i in live], **sub_kwargs)
        for i, res in zip(live, results):
            if guards.dedup_claims:
                res.claims, res.verdicts = dedup_claims(res.claims, res.verdicts)
            checks[i] = res
    return checks, hits


def check_details(check: FactCheck | None) -> dict[str, Any]:
    """Why a response got its reward, for ``details[i]``: the claims checked and each one's verdict (``{}`` for a
    blank completion, which was not checked)."""
    if check is None:
        return {}
    by_id = {v.claim_id: v.label.value for v in check.verdicts}
    return {"claims": [c.text for c in check.claims], "verdicts": [by_id.get(c.id) for c in check.claims]}


def pipeline_from(spec: FactualityPipeline | Mapping[str, Any], judge: Any,
                  judge_defaults: Mapping[str, Any] | None = None) -> FactualityPipeline:
    """A built pipeline, or one from its config (stage ``judge:`` blocks laid over ``judge_defaults``)."""
    if isinstance(spec, FactualityPipeline):
        return spec
    return build_pipeline(dict(spec), judge_client=judge, judge_defaults=judge_defaults)


def role_judge(role: Any, shared: Any) -> Any:
    """The client for one role: its own block laid key by key over the shared block; None when it has none."""
    if role is None or hasattr(role, "complete_batch"):
        return role
    base = dict(shared) if isinstance(shared, Mapping) else {}
    return build_judge({**base, **dict(role)})


def judge_from(spec: Any) -> Any:
    if spec is None or hasattr(spec, "complete_batch"):
        return spec
    return build_judge(spec)


def extract_answer(text: str) -> str | None:
    """The last ``<answer>...</answer>`` content, stripped (None if absent)."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def extract_think(text: str) -> str | None:
    found = _THINK.findall(text)
    return found[-1] if found else None
