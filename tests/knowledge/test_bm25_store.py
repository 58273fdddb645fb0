"""The tantivy-backed store: real BM25, atomic swap, pinned readers, corruption, migration, parallel readers."""

import json
import math
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from nemo_factuality.cli import main as cli
from nemo_factuality.knowledge import bm25_index
from nemo_factuality.knowledge.legacy_fts5 import Fts5Store, build_fts5_store
from nemo_factuality.knowledge.store import KnowledgeStore, bm25_root, build_store, write_store
from nemo_factuality.types import FactualityInputError

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


def _synthetic(n):
    return [{"title": f"Entity {i % 7}", "text": f"entity {i} word{i % 13} word{i % 5} shared text number {i * 7 % 101}"}
            for i in range(n)]


@pytest.fixture
def kb(tmp_path):
    return build_store(_jsonl(tmp_path / "p.jsonl", PASSAGES), tmp_path / "kb.sqlite",
                       facts_jsonl=_jsonl(tmp_path / "f.jsonl", FACTS), progress=False)


@pytest.fixture
def big_kb(tmp_path):
    return build_store(_jsonl(tmp_path / "big.jsonl", _synthetic(600)), tmp_path / "big.sqlite", progress=False)


def _lucene_bm25(query, docs, k1=1.2, b=0.75):
    """Reference BM25 (Lucene/tantivy IDF) over whitespace-tokenised docs."""
    n, avgdl = len(docs), sum(map(len, docs)) / len(docs)
    df = Counter(t for d in docs for t in set(d))
    out = []
    for d in docs:
        tf, s = Counter(d), 0.0
        for t in query:
            if tf[t]:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                s += idf * tf[t] * (k1 + 1) / (tf[t] + k1 * (1 - b + b * len(d) / avgdl))
        out.append(s)
    return out


def test_scores_are_real_bm25(tmp_path):
    # Short docs: tantivy's field-norm encoding is exact below ~40 tokens; titles share no word with the query.
    texts = ["apple banana apple", "banana cherry", "cherry cherry date elder", "apple fig fig", "grape"]
    rows = [{"title": f"t{i}", "text": t} for i, t in enumerate(texts)]
    store = KnowledgeStore(build_store(_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "kb.sqlite", progress=False))
    ref = _lucene_bm25(["apple", "cherry"], [t.split() for t in texts])
    hits = store.search("Apple, CHERRY!", k=10)
    assert [h.id for h in hits] == sorted((i + 1 for i in range(5) if ref[i] > 0), key=lambda pid: -ref[pid - 1])
    for h in hits:
        assert h.score == pytest.approx(ref[h.id - 1], rel=1e-4)


def test_query_analysis_matches_the_index(tmp_path):
    text = "Héllo WORLD, it's Baden-Württemberg_x 2024 naïve"
    store = KnowledgeStore(build_store(_jsonl(tmp_path / "p.jsonl", [{"title": "T", "text": text}]), tmp_path / "kb.sqlite",
                                       progress=False))
    terms = bm25_index.query_terms(text)
    assert "württemberg" in terms and "héllo" in terms
    for term in terms:
        assert [h.id for h in store.search(term)] == [1], term


def test_k_is_clamped_or_rejected(kb):
    store = KnowledgeStore(kb)
    assert len(store.search("Einstein", k=2**63)) == 3
    assert len(store.search_batch(["Einstein"], k=2**63)[0]) == 3
    assert store.search("Einstein", k=-1) == [] and store.search("Einstein", k=0) == []
    with pytest.raises(FactualityInputError, match="k .* must be an integer"):
        store.search("Einstein", k="5")


def test_lone_surrogates(kb, tmp_path):
    store = KnowledgeStore(kb)
    with pytest.raises(FactualityInputError, match="not valid Unicode"):
        store.search("born", title="Ulm\ud800")
    assert store.search("Ulm \udc80 born", k=1)[0].title in {"Ulm", "Albert Einstein"}  # the bad char is dropped
    src = tmp_path / "bad.jsonl"
    src.write_text('{"title": "ok", "text": "fine"}\n{"title": "x\\ud800", "text": "y"}\n')
    with pytest.raises(FactualityInputError, match=r"bad.jsonl:2: field 'title' holds a lone surrogate"):
        build_store(src, tmp_path / "bad.sqlite", progress=False)
    assert not (tmp_path / "bad.sqlite").exists() and not bm25_root(tmp_path / "bad.sqlite").exists()


def test_build_is_invisible_until_complete_and_readers_stay_pinned(kb, tmp_path):
    old = KnowledgeStore(kb)
    old_gen = old.generation
    seen = {}

    def rows():
        yield None, "New", "a passage about zebras", None
        # Mid-build: the path still holds the old, complete store.
        mid = KnowledgeStore(kb)
        seen["mid"] = (mid.generation, mid.count(), mid.search("zebras"))
        mid.close()
        yield None, "New", "another passage about zebras", None

    write_store(kb, rows(), progress=False)
    assert seen["mid"] == (old_gen, (4, 1), [])
    new = KnowledgeStore(kb)
    assert new.generation != old_gen and new.count() == (2, 0) and len(new.search("zebras")) == 2
    assert sorted(p.name for p in bm25_root(kb).iterdir()) == [new.generation]  # old generation dropped
    # The old reader keeps answering from the build it opened, in this thread and in new threads.
    assert old.search("Warsaw", k=1)[0].title == "Marie Curie"
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(lambda: (old.count(), old.search("Warsaw", k=1)[0].title)).result() == ((4, 1), "Marie Curie")
    assert old.health() is None


def test_concurrent_reader_threads(big_kb):
    store = KnowledgeStore(big_kb)
    queries = [f"word{i % 13} number {i % 101} entity {i}" for i in range(300)]
    titles = [None if i % 3 else f"Entity {i % 7}" for i in range(300)]
    expected = [store.search(q, k=4, title=t) for q, t in zip(queries, titles)]
    barrier = threading.Barrier(8)

    def work(offset):
        barrier.wait()
        return [store.search(queries[i], k=4, title=titles[i]) for i in range(offset, 300, 8)]

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(work, range(8)))
    for offset, got in enumerate(results):
        assert got == expected[offset::8]
    assert all(h.title == titles[i] for i in range(0, 300, 3) for h in expected[i])


def test_batched_search_in_worker_processes_matches_serial(big_kb):
    store = KnowledgeStore(big_kb)
    queries = [f"word{i % 13} shared {i}" for i in range(200)]
    titles = [f"Entity {i % 7}" if i % 2 else None for i in range(200)]
    serial = store.search_batch(queries, k=3, titles=titles, workers=1)
    parallel = store.search_batch(queries, k=3, titles=titles, workers=2)  # 200 >= 32 * 2: two processes
    assert parallel == serial and all(len(s) == 3 for s in serial)
    store.close()
    # Workers answer with the parent's query options (here: pruning "shared", in every passage).
    pruning = KnowledgeStore(big_kb, min_passages_for_pruning=1)
    pruned = pruning.search_batch(queries, k=3, titles=titles, workers=2)
    assert pruned == pruning.search_batch(queries, k=3, titles=titles, workers=1) and pruned != serial
    pruning.close()
    with pytest.raises(FactualityInputError, match="2 queries but 1 titles"):
        KnowledgeStore(big_kb).search_batch(["a", "b"], titles=["x"])


_ORPHAN_MAKER = """
import os, sys
from nemo_factuality.knowledge.store import KnowledgeStore
store = KnowledgeStore(sys.argv[1])
store.search_batch([f"word{i % 13} shared {i}" for i in range(200)], k=3, workers=2)
print(" ".join(str(p.pid) for p in store._pool._pool._processes.values()), flush=True)
os.kill(os.getpid(), 9)  # the command ends without closing its pool (a SIGKILL, a stop before the shutdown)
"""


def test_search_workers_end_with_the_process_that_started_them(big_kb):
    """A spawned pool's workers each hold both ends of its call queue, so a parent that dies without shutting the
    pool down left them blocked forever (orphans re-parented to PID 1, the store open). They now exit within a
    second or two of their parent."""
    import os
    import time

    out = big_kb.parent / "orphan_maker.out"
    with open(out, "w") as sink:  # a file, not a pipe: orphans holding a pipe would keep run() waiting for its end
        res = subprocess.run([sys.executable, "-c", _ORPHAN_MAKER, str(big_kb)], stdout=sink, stderr=subprocess.STDOUT,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert res.returncode == -9, out.read_text()[-2000:]
    workers = [int(p) for p in out.read_text().split()]
    assert len(workers) == 2
    deadline = time.monotonic() + 15
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
        time.sleep(0.2)
    for pid in alive:  # leave nothing behind whatever the outcome
        os.kill(pid, 9)
    assert not alive, f"search workers {alive} outlived their parent"


_READER = """
import json, sys
from nemo_factuality.knowledge.store import KnowledgeStore
store = KnowledgeStore(sys.argv[1])
print(json.dumps([[p.id for p in store.search(f"word{i} shared", k=3)] for i in range(13)]))
"""


def test_two_reader_processes_share_one_index(big_kb):
    expected = [[p.id for p in KnowledgeStore(big_kb).search(f"word{i} shared", k=3)] for i in range(13)]
    procs = [subprocess.Popen([sys.executable, "-c", _READER, str(big_kb)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [json.loads(o) for o in outs] == [expected, expected]


def _segment_file(store_path):
    store = KnowledgeStore(store_path)
    files = [p for p in store.index_dir.iterdir() if p.suffix == ".idx"]
    store.close()
    return files[0]


def test_corrupted_index_is_a_clear_error(kb):
    seg = _segment_file(kb)
    data = bytearray(seg.read_bytes())
    data[len(data) // 2] ^= 0xFF
    seg.write_bytes(bytes(data))  # same size, one byte flipped
    with pytest.raises(FactualityInputError, match="fails its CRC32 check .*kb build"):
        KnowledgeStore(kb)
    seg.write_bytes(bytes(data[:10]))
    with pytest.raises(FactualityInputError, match="has 10 bytes, expected"):
        KnowledgeStore(kb, verify=False)


def test_health_reports_broken_or_missing_store(kb, tmp_path):
    store = KnowledgeStore(kb)
    assert store.health() is None
    seg = _segment_file(kb)
    seg.write_bytes(seg.read_bytes()[:5])
    assert "has 5 bytes" in store.health()
    kb.rename(tmp_path / "moved.sqlite")
    assert "no longer exists" in store.health()


def test_missing_index_directory(kb):
    import shutil

    shutil.rmtree(bm25_root(kb))
    with pytest.raises(FactualityInputError, match="BM25 index directory .* is missing"):
        KnowledgeStore(kb)


def test_fts5_store_migrates_with_one_command(tmp_path, capsys):
    passages, facts = _jsonl(tmp_path / "p.jsonl", PASSAGES), _jsonl(tmp_path / "f.jsonl", FACTS)
    old = build_fts5_store(passages, tmp_path / "old.sqlite", facts_jsonl=facts)
    fts_top = Fts5Store(old).search("Warsaw Nobel", k=1)[0]
    with pytest.raises(FactualityInputError, match=r"old SQLite-FTS5 format; migrate it once with 'nemo-factuality kb migrate --kb"):
        KnowledgeStore(old)
    assert cli(["kb", "migrate", "--kb", str(old)]) == 0
    assert "migrated" in capsys.readouterr().out
    store = KnowledgeStore(old)
    top = store.search("Warsaw Nobel", k=1)[0]
    assert (top.id, top.title, top.text) == (fts_top.id, fts_top.title, fts_top.text)
    assert store.count() == (4, 1) and store.facts_about("Albert Einstein")[0].value == "Ulm"
    assert cli(["kb", "migrate", "--kb", str(old)]) == 2
    assert "nothing to migrate" in capsys.readouterr().err


def test_kb_build_demo_and_query(tmp_path, capsys):
    out = tmp_path / "demo.sqlite"
    assert cli(["kb", "build", "--demo", "--out", str(out), "--heap-mb", "32"]) == 0
    n_pass, n_facts = KnowledgeStore(out).count()
    assert n_pass > 0 and n_facts > 0
    capsys.readouterr()
    assert cli(["kb", "build", "--demo", "--out", str(out), "--heap-mb", "1"]) == 2
    assert "heap_mb must be >= 16" in capsys.readouterr().err


def test_not_a_store(tmp_path):
    import sqlite3

    conn = sqlite3.connect(tmp_path / "other.sqlite")
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    with pytest.raises(FactualityInputError, match="not a nemo_factuality knowledge store"):
        KnowledgeStore(tmp_path / "other.sqlite")
    assert Path(tmp_path / "other.sqlite").is_file()


def test_stop_word_terms_are_pruned_on_large_stores(tmp_path):
    rows = [{"title": f"T{i}", "text": f"the common filler {i}" + (" zebra" if i == 7 else "")} for i in range(1200)]
    path = build_store(_jsonl(tmp_path / "p.jsonl", rows), tmp_path / "kb.sqlite", progress=False)
    pruned, exact = KnowledgeStore(path), KnowledgeStore(path, max_df_frac=1.0)
    # "the"/"common"/"filler" are in every passage: dropped, so only the zebra passage matches.
    assert [h.title for h in pruned.search("the common zebra", k=3)] == ["T7"]
    hits = exact.search("the common zebra", k=3)
    assert hits[0].title == "T7" and len(hits) == 3 and hits[0].score > hits[1].score
    assert len(pruned.search("the common", k=3)) == 3  # all terms common: the rarest is kept
    with pytest.raises(FactualityInputError, match="max_df_frac must be in"):
        KnowledgeStore(path, max_df_frac=0.0)


def test_reward_readiness_reports_a_deleted_store(kb):
    from nemo_factuality.knowledge.evidence import KnowledgeStoreEvidence
    from nemo_factuality.pipeline import merged_health

    ev = KnowledgeStoreEvidence(str(kb), workers=1)
    assert merged_health([ev]) == {"knowledge_store": None}
    kb.unlink()
    assert "no longer exists" in merged_health([ev])["knowledge_store"]
