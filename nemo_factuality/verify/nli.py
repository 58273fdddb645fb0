"""Cross-encoder NLI verifier from a local Hugging Face model path (no hub access at run time).

FSPO uses an HHEM-style consistency classifier (supported if p > 0.5); KnowRL uses DeBERTa NLI
with entailment probability >= 0.3, taking the max over retrieved passages. Both are this class
with a different ``threshold`` and ``entail_label``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

from nemo_factuality.interfaces import VerifyItem
from nemo_factuality.registry import VERIFIERS
from nemo_factuality.types import FactualityInputError, Label, Verdict

log = logging.getLogger(__name__)


@VERIFIERS.register("nli")
class NLIVerifier:
    """p(supported) = softmax(logits)[entail_label] of (evidence passage, claim), aggregated over passages.

    Args:
        model_path: local directory with a sequence-classification model and its tokenizer.
        threshold: p(supported) at or above which the claim is SUPPORTED (FSPO 0.5, KnowRL 0.3).
        entail_label: the label name in the model config's ``label2id`` (case-insensitive) or its index.
        aggregation: ``max`` (KnowRL) or ``mean`` over evidence passages.
        batch_size: pairs per forward pass.
        max_length: truncation length of each (passage, claim) pair.
    """

    def __init__(self, model_path: str, threshold: float = 0.5, entail_label: str | int = "entailment",
                 aggregation: str = "max", batch_size: int = 16, max_length: int = 512, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FactualityInputError(f"NLI model path {path} has no config.json; point verifier.model_path at a local "
                                       "sequence-classification model directory")
        if aggregation not in ("max", "mean"):
            raise FactualityInputError(f"NLI aggregation must be 'max' or 'mean', got {aggregation!r}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path)).to(device).eval()
        self.entail_index = self._resolve_label(entail_label)
        self.threshold, self.aggregation, self.batch_size = threshold, aggregation, batch_size
        self.max_length, self.device, self._torch = max_length, device, torch
        self.stats = {"claims_verified": 0, "pairs_scored": 0}

    def _resolve_label(self, label: str | int) -> int:
        n = self.model.config.num_labels
        if isinstance(label, int):
            if not 0 <= label < n:
                raise FactualityInputError(f"entail_label index {label} out of range for a {n}-label model")
            return label
        lookup = {k.lower(): v for k, v in (self.model.config.label2id or {}).items()}
        if label.lower() not in lookup:
            raise FactualityInputError(f"entail_label {label!r} not in the model's labels {sorted(lookup)}; "
                                       "set verifier.entail_label to one of them or to an index")
        return int(lookup[label.lower()])

    def _probs(self, pairs: list[tuple[str, str]]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start : start + self.batch_size]
            enc = self.tokenizer([p for p, _ in chunk], [h for _, h in chunk], truncation=True, padding=True,
                                 max_length=self.max_length, return_tensors="pt").to(self.device)
            with self._torch.no_grad():
                logits = self.model(**enc).logits
            out.extend(self._torch.softmax(logits.float(), dim=-1)[:, self.entail_index].tolist())
        self.stats["pairs_scored"] += len(pairs)
        return out

    def verify_batch(self, items: Sequence[VerifyItem]) -> list[Verdict]:
        pairs, owners = [], []
        for idx, item in enumerate(items):
            for passage in item.evidence:
                pairs.append((passage, item.claim.text))
                owners.append(idx)
        probs = self._probs(pairs) if pairs else []
        per_item: list[list[float]] = [[] for _ in items]
        for idx, p in zip(owners, probs):
            per_item[idx].append(p)
        verdicts = []
        for item, ps in zip(items, per_item):
            if not ps:
                verdicts.append(Verdict(item.claim.id, Label.NOT_ENOUGH_INFO, score=0.0, error=None))
                continue
            score = max(ps) if self.aggregation == "max" else sum(ps) / len(ps)
            label = Label.SUPPORTED if score >= self.threshold else Label.NOT_SUPPORTED
            verdicts.append(Verdict(item.claim.id, label, score=min(max(score, 0.0), 1.0), evidence=item.evidence))
        self.stats["claims_verified"] += len(items)
        return verdicts
