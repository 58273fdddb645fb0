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

import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from nemo_factuality.cli import ArgumentParser, UsageError, positive_int
from nemo_factuality.fileio import input_file, output_file

SCORE_NOTE = {
    "bm25": "# rank 1 = best match. score = BM25 relevance (higher is better; it only compares passages for the "
            "same query; words in more than 30% of passages are left out of the query on large stores)",
    "dense": "# rank 1 = best match. score = cosine similarity of the MiniLM embeddings (-1..1, higher is better)",
}


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="nemo-factuality kb", description="embedded knowledge store (SQLite + tantivy BM25)")
    sub = p.add_subparsers(dest="action", required=True, metavar="{build,query,migrate}")
    b = sub.add_parser("build", help="stream passages (and facts) from JSONL into a store",
                       description="stream passages (and facts) from JSONL into a store")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--passages", type=Path, help='JSONL lines {"title", "text"}')
    src.add_argument("--demo", action="store_true", help="the packaged demo passages and facts (invented people)")
    src.add_argument("--factscore-db", type=Path, help="a FActScore documents(title, text) SQLite DB")
    b.add_argument("--facts", type=Path, help='JSONL lines {"subject", "relation", "value", "text"}')
    b.add_argument("--out", type=Path, required=True, help="the store to write (SQLite file, replaced atomically)")
    b.add_argument("--batch-size", type=positive_int, default=10_000, help="passages inserted per transaction")
    b.add_argument("--heap-mb", type=positive_int, default=256,
                   help="BM25 indexing memory budget in MB (bounds the build's memory)")
    b.add_argument("--dense", action="store_true", help="also embed passages into a FAISS index (retrieval extra)")
    q = sub.add_parser("query", help="search a store (BM25, or --dense)", description="search a store (BM25, or --dense); "
                       "prints one JSON line per passage, best first, with its rank and score")
    q.add_argument("--kb", type=Path, required=True, help="the store built with 'kb build'")
    q.add_argument("text", help="the query (any text; quoting is handled)")
    q.add_argument("--title", help="only passages of this title (exact)")
    q.add_argument("-k", type=positive_int, default=5, help="how many passages to show")
    q.add_argument("--dense", action="store_true", help="search the FAISS index instead of BM25")
    m = sub.add_parser("migrate", help="rewrite an old SQLite-FTS5 store in the current format (keeps ids and facts)",
                       description="rewrite an old SQLite-FTS5 store in place, atomically, in the current format "
                       "(tantivy BM25); passage ids, facts and a dense index stay valid")
    m.add_argument("--kb", type=Path, required=True, help="the FTS5-format store to migrate")
    return p


def _require_file(path: Path | None, flag: str) -> None:
    if path is not None:
        input_file(path, flag, suffixes=(".jsonl", ".db", ".sqlite"), hint=f"{flag} takes a file")


def main(argv: Sequence[str]) -> int:
    from nemo_factuality.knowledge.store import KnowledgeStore, build_store, docdb_to_jsonl

    args = build_parser().parse_args(list(argv))
    if args.action == "migrate":
        from nemo_factuality.knowledge.legacy_fts5 import migrate_fts5_store

        out = migrate_fts5_store(args.kb)
        n_pass, n_facts = KnowledgeStore(out).count()
        print(f"migrated {out}: {n_pass} passages, {n_facts} facts")
        return 0
    if args.action == "build":
        passages = args.passages
        for path, flag in ((args.passages, "--passages"), (args.facts, "--facts"), (args.factscore_db, "--factscore-db")):
            _require_file(path, flag)
        output_file(args.out, "--out", "kb.sqlite")  # before indexing: a directory failed only at the rename
        if args.demo:
            data = Path(__file__).resolve().parents[1] / "data"
            passages, args.facts = data / "demo_passages.jsonl", data / "demo_facts.jsonl"
        with tempfile.TemporaryDirectory() as tmp:
            if args.factscore_db is not None:
                passages = Path(tmp) / "passages.jsonl"
                if not docdb_to_jsonl(args.factscore_db, passages):
                    raise UsageError(f"--factscore-db {args.factscore_db} has no passages (its documents table is empty)")
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
    print(SCORE_NOTE["dense" if args.dense else "bm25"], file=sys.stderr)
    for rank, p in enumerate(searcher.search(args.text, k=args.k, title=args.title), start=1):
        print(json.dumps({"rank": rank, "score": float(f"{p.score:.4g}"), "id": p.id, "title": p.title, "text": p.text},
                         ensure_ascii=False))
    return 0
