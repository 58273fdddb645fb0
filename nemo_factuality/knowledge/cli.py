"""``nemo-factuality kb build|query``: build and query the embedded knowledge store.

    nemo-factuality kb build --passages passages.jsonl --out kb.sqlite [--facts facts.jsonl] [--batch-size N]
    nemo-factuality kb build --factscore-db enwiki-20230401.db --out kb.sqlite
    nemo-factuality kb build --demo --out kb.sqlite                                  # packaged demo data
    nemo-factuality kb build --passages passages.jsonl --out kb.sqlite --dense      # + FAISS index
    nemo-factuality kb query --kb kb.sqlite "born in Ulm" [--title "Albert Einstein"] [-k 5] [--dense]
    nemo-factuality kb migrate --kb kb.sqlite       # an old SQLite-FTS5 store → the tantivy format, in place

A store is ``kb.sqlite`` (passages, facts) plus its BM25 index in ``kb.sqlite.bm25/``; copy or move both.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-factuality kb", description="embedded knowledge store (SQLite + tantivy BM25)")
    sub = p.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="stream passages (and facts) from JSONL into a store")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--passages", type=Path, help='JSONL lines {"title", "text"}')
    src.add_argument("--demo", action="store_true", help="the packaged demo passages and facts (invented people)")
    src.add_argument("--factscore-db", type=Path, help="a FActScore documents(title, text) SQLite DB")
    b.add_argument("--facts", type=Path, help='JSONL lines {"subject", "relation", "value", "text"}')
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--batch-size", type=int, default=10_000)
    b.add_argument("--heap-mb", type=int, default=256, help="BM25 indexing memory budget (bounds the build's memory)")
    b.add_argument("--dense", action="store_true", help="also embed passages into a FAISS index (retrieval extra)")
    q = sub.add_parser("query", help="BM25 search")
    q.add_argument("--kb", type=Path, required=True)
    q.add_argument("text")
    q.add_argument("--title")
    q.add_argument("-k", type=int, default=5)
    q.add_argument("--dense", action="store_true", help="search the FAISS index instead of BM25")
    m = sub.add_parser("migrate", help="rewrite an old SQLite-FTS5 store in the current format (keeps ids and facts)")
    m.add_argument("--kb", type=Path, required=True)
    return p


def main(argv: Sequence[str]) -> int:
    from nemo_factuality.knowledge.store import KnowledgeStore, build_store, docdb_to_jsonl

    args = _parser().parse_args(list(argv))
    if args.action == "migrate":
        from nemo_factuality.knowledge.legacy_fts5 import migrate_fts5_store

        out = migrate_fts5_store(args.kb)
        n_pass, n_facts = KnowledgeStore(out).count()
        print(f"migrated {out}: {n_pass} passages, {n_facts} facts")
        return 0
    if args.action == "build":
        passages = args.passages
        if args.demo:
            data = Path(__file__).resolve().parents[1] / "data"
            passages, args.facts = data / "demo_passages.jsonl", data / "demo_facts.jsonl"
        with tempfile.TemporaryDirectory() as tmp:
            if args.factscore_db is not None:
                passages = Path(tmp) / "passages.jsonl"
                docdb_to_jsonl(args.factscore_db, passages)
            out = build_store(passages, args.out, facts_jsonl=args.facts, batch_size=args.batch_size, heap_mb=args.heap_mb)
        if args.dense:
            from nemo_factuality.knowledge.dense import build_dense_index

            print(f"dense index: {build_dense_index(out)}")
        n_pass, n_facts = KnowledgeStore(out).count()
        print(f"built {out}: {n_pass} passages, {n_facts} facts")
        return 0
    if args.dense:
        from nemo_factuality.knowledge.dense import DenseIndex

        searcher = DenseIndex(args.kb)
    else:
        searcher = KnowledgeStore(args.kb)
    for p in searcher.search(args.text, k=args.k, title=args.title):
        print(json.dumps({"id": p.id, "title": p.title, "score": round(p.score, 4), "text": p.text}, ensure_ascii=False))
    return 0
