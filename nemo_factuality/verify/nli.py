"""Cross-encoder NLI verifier from a local Hugging Face model path (no hub access at run time).

FSPO uses an HHEM-style consistency classifier (supported if p > 0.5); KnowRL uses DeBERTa NLI
with entailment probability >= 0.3, taking the max over retrieved passages. Both are this class
with a different ``threshold`` and ``entail_label``.

Heads: a multi-class head gives p = softmax(logits)[entail_label]; a single-logit head (HHEM: one
consistency logit) gives p = sigmoid(logit) — a softmax over one logit would always be 1.0, i.e.
every step SUPPORTED. ``prompt_template`` renders each (premise, hypothesis) pair into one text the
way the model was trained (HHEM-2.1's ``"<pad> Determine if the hypothesis is true given the
premise?\n\nPremise: {premise}\n\nHypothesis: {hypothesis}"``); ``trust_remote_code`` is an
explicit opt-in for models that ship their own modelling code.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

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
                 aggregation: str = "max", batch_size: int = 16, max_length: int = 512, device: str = "cpu",
                 prompt_template: str | None = None, trust_remote_code: bool = False) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from nemo_factuality.local_models import check_model_dir, from_pretrained

        key = "verifier.model_path"  # a local sequence-classification (NLI) model directory
        path = check_model_dir(model_path, key, tokenizer=True)
        if aggregation not in ("max", "mean"):
            raise FactualityInputError(f"NLI aggregation must be 'max' or 'mean', got {aggregation!r}")
        if prompt_template is not None and ("{premise}" not in prompt_template or "{hypothesis}" not in prompt_template):
            raise FactualityInputError("verifier.prompt_template must contain {premise} and {hypothesis}")
        self.tokenizer = from_pretrained(AutoTokenizer.from_pretrained, path, key, trust_remote_code=trust_remote_code)
        self.model = from_pretrained(AutoModelForSequenceClassification.from_pretrained, path, key,
                                     trust_remote_code=trust_remote_code)
        self.model = self.model.to(device).eval()
        self.prompt_template = prompt_template
        self.single_logit = self.model.config.num_labels == 1
        self.entail_index = 0 if self.single_logit else self._resolve_label(entail_label)
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
            if self.prompt_template is not None:  # the model's own single-text input format
                texts = [self.prompt_template.format(premise=p, hypothesis=h) for p, h in chunk]
                enc = self.tokenizer(texts, truncation=True, padding=True, max_length=self.max_length, return_tensors="pt")
            else:
                enc = self.tokenizer([p for p, _ in chunk], [h for _, h in chunk], truncation=True, padding=True,
                                     max_length=self.max_length, return_tensors="pt")
            with self._torch.no_grad():
                logits = self.model(**enc.to(self.device)).logits.float()
            probs = self._torch.sigmoid(logits[:, 0]) if self.single_logit else self._torch.softmax(logits, dim=-1)[:, self.entail_index]
            out.extend(probs.tolist())
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
