import json

import pytest

from nemo_factuality.knowledge.store import build_store

FACTS = [
    ("Ada Varga", "born_year", "1917", "Ada Varga was born in 1917."),
    ("Ada Varga", "birthplace", "Ostrava", "Ada Varga grew up in Ostrava."),
    ("Lev Novak", "born_year", "1950", "Lev Novak was born in 1950."),
    ("Lev Novak", "occupation", "chemist", "Lev Novak worked as a chemist."),
]


@pytest.fixture(scope="session")
def kb(tmp_path_factory):
    d = tmp_path_factory.mktemp("rewards_kb")
    (d / "p.jsonl").write_text("".join(json.dumps({"title": s, "text": t}) + "\n" for s, _, _, t in FACTS))
    (d / "f.jsonl").write_text("".join(json.dumps({"subject": s, "relation": r, "value": v, "text": t}) + "\n"
                                       for s, r, v, t in FACTS))
    return str(build_store(d / "p.jsonl", d / "kb.sqlite", facts_jsonl=d / "f.jsonl", progress=False))


@pytest.fixture(scope="session")
def kb_pipeline(kb):
    from nemo_factuality.pipeline import build_pipeline

    return build_pipeline({"verifier": {"name": "kb_exact", "store_path": kb}})
