"""Retrieval throughput: the embedded SQLite FTS5 store vs rank_bm25's BM25Okapi (what FActScore uses).

Both index the same synthetic passages and answer the same queries in one run:

    python benchmarks/retrieval_bench.py [--passages 100000] [--queries 1000] [--bm25-queries 100]

rank_bm25 scores every passage per query in Python, so it is timed on the first ``--bm25-queries``
queries (its per-query cost does not depend on which queries), and queries/s are compared.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

WORDS = [f"w{i}" for i in range(20_000)]


def synth(n_passages: int, n_queries: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    rng = random.Random(seed)
    # Zipf-like word use so BM25 statistics look like real text.
    weights = [1 / (i + 1) for i in range(len(WORDS))]
    passages = [{"title": f"Entity {i % 5000}", "text": " ".join(rng.choices(WORDS, weights, k=60))} for i in range(n_passages)]
    queries = [" ".join(rng.choices(WORDS, weights, k=6)) for _ in range(n_queries)]
    return passages, queries


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=1_000)
    ap.add_argument("--bm25-queries", type=int, default=100)
    ap.add_argument("-k", type=int, default=5)
    args = ap.parse_args()

    from rank_bm25 import BM25Okapi

    from nemo_factuality.knowledge.store import KnowledgeStore, build_store

    passages, queries = synth(args.passages, args.queries)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "p.jsonl"
        src.write_text("".join(json.dumps(p) + "\n" for p in passages))
        t0 = time.perf_counter()
        store = KnowledgeStore(build_store(src, Path(tmp) / "kb.sqlite", progress=False))
        fts_build = time.perf_counter() - t0
        t0 = time.perf_counter()
        for q in queries:
            store.search(q, k=args.k)
        fts_time = time.perf_counter() - t0

        t0 = time.perf_counter()
        bm25 = BM25Okapi([p["text"].split() for p in passages])
        bm25_build = time.perf_counter() - t0
        sub = queries[: args.bm25_queries]
        t0 = time.perf_counter()
        for q in sub:
            scores = bm25.get_scores(q.split())
            scores.argsort()[-args.k:]
        bm25_time = time.perf_counter() - t0

    fts_qps, bm25_qps = len(queries) / fts_time, len(sub) / bm25_time
    print(f"passages={args.passages} queries={len(queries)} (rank_bm25 timed on {len(sub)}) k={args.k}")
    print(f"{'':22}{'build s':>10}{'queries/s':>12}{'p50 ms/query':>14}")
    print(f"{'SQLite FTS5 (ours)':22}{fts_build:>10.2f}{fts_qps:>12.1f}{1000 / fts_qps:>14.2f}")
    print(f"{'rank_bm25 BM25Okapi':22}{bm25_build:>10.2f}{bm25_qps:>12.1f}{1000 / bm25_qps:>14.2f}")
    print(f"speed-up (queries/s): {fts_qps / bm25_qps:.1f}x")


if __name__ == "__main__":
    main()
