"""Offline verifiers: the exact KB verifier and the NLI cross-encoder (tiny local model, known probabilities)."""

import json

import pytest
import torch

from nemo_factuality.interfaces import VerifyItem
from nemo_factuality.knowledge.store import build_store
from nemo_factuality.types import Claim, FactualityInputError, Label
from nemo_factuality.verify.kb import KBExactVerifier
from nemo_factuality.verify.nli import NLIVerifier


@pytest.fixture(scope="module")
def kb_path(tmp_path_factory):
    d = tmp_path_factory.mktemp("kb")
    (d / "p.jsonl").write_text(json.dumps({"title": "Ada Varga", "text": "Ada Varga was born in 1917."}) + "\n")
    facts = [{"subject": "Ada Varga", "relation": "born_year", "value": "1917", "text": "Ada Varga was born in 1917."},
             {"subject": "Ada Varga", "relation": "birthplace", "value": "Ostrava", "text": "Ada Varga grew up in Ostrava."},
             {"subject": "Lev Novak", "relation": "born_year", "value": "1950", "text": "Lev Novak was born in 1950."}]
    (d / "f.jsonl").write_text("".join(json.dumps(f) + "\n" for f in facts))
    return str(build_store(d / "p.jsonl", d / "kb.sqlite", facts_jsonl=d / "f.jsonl", progress=False))


@pytest.mark.parametrize("text,label", [
    ("Ada Varga was born in 1917.", Label.SUPPORTED),
    ("ada varga   was born in 1917", Label.SUPPORTED),
    ("Lev Novak was born in 1917.", Label.NOT_SUPPORTED),
    ("Ada Varga grew up in Lyon.", Label.NOT_SUPPORTED),
    ("Ada Varga grew up in unknown.", Label.IRRELEVANT),
    ("Greta Brandt was born in 1917.", Label.NOT_ENOUGH_INFO),
    ("Ada Varga climbed a mountain.", Label.NOT_ENOUGH_INFO),
])
def test_kb_exact_verifier(kb_path, text, label):
    (v,) = KBExactVerifier(kb_path).verify_batch([VerifyItem(Claim(3, text))])
    assert v.label is label and v.claim_id == 3 and v.evidence


def _tiny_nli(path, tokenizer_dir, bias):
    """A 1-layer BERT classifier whose output depends only on the classifier bias (weights zeroed)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                     num_labels=3, id2label={0: "entailment", 1: "neutral", 2: "contradiction"},
                     label2id={"entailment": 0, "neutral": 1, "contradiction": 2})
    model = BertForSequenceClassification(cfg)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor(bias))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def test_nli_threshold_label_and_aggregation(tmp_path, tiny_tokenizer_dir):
    # bias [ln 3, 0, 0] -> softmax = [3/5, 1/5, 1/5]: p(entail) = 0.6
    path = _tiny_nli(tmp_path / "nli", tiny_tokenizer_dir, [1.0986123, 0.0, 0.0])
    items = [VerifyItem(Claim(0, "c"), evidence=("e1", "e2")), VerifyItem(Claim(1, "d"))]
    hhem = NLIVerifier(str(path), threshold=0.5, entail_label="Entailment")
    out = hhem.verify_batch(items)
    assert out[0].label is Label.SUPPORTED and out[0].score == pytest.approx(0.6, abs=1e-5)
    assert out[1].label is Label.NOT_ENOUGH_INFO  # no evidence, no verdict
    strict = NLIVerifier(str(path), threshold=0.7, entail_label=0, aggregation="mean")
    assert strict.verify_batch(items[:1])[0].label is Label.NOT_SUPPORTED
    assert hhem.stats["pairs_scored"] == 2


def test_nli_bad_config(tmp_path, tiny_tokenizer_dir):
    path = _tiny_nli(tmp_path / "nli", tiny_tokenizer_dir, [0.0, 0.0, 0.0])
    with pytest.raises(FactualityInputError, match="not in the model's labels"):
        NLIVerifier(str(path), entail_label="supported")
    with pytest.raises(FactualityInputError, match="verifier.model_path=.*missing: no such directory"):
        NLIVerifier(str(tmp_path / "missing"))
