"""Retrieval throughput: the knowledge store (tantivy BM25) vs the old SQLite FTS5 store vs rank_bm25.

Default run: all three index the same synthetic passages and answer the same queries in one run;
ratios are computed on the same queries (rank_bm25 and FTS5 are timed on the first
``--bm25-queries`` / ``--fts-queries`` queries; the store's per-query times give its rate on
exactly those). Batched: ``search_batch`` on every core (worker processes)::

    python benchmarks/retrieval_bench.py [--passages 100000] [--queries 1000]

Scale run: Wikipedia-sized passages (``--words`` words from a Zipf vocabulary), built and queried
at several sizes, each build and each query run in a fresh process (peak RSS is that process's)::

    python benchmarks/retrieval_bench.py --scale 100000,500000,1000000,2000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(20_000)]


def synth(n_passages: int, n_queries: int, seed: int = 0) -> tuple[list[dict], list[str]]:
    """The default data (unchanged since the FTS5 measurements): 60-word passages, 6-word queries."""
    import random

    rng = random.Random(seed)
    # Zipf-like word use so BM25 statistics look like real text.
    weights = [1 / (i + 1) for i in range(len(WORDS))]
    passages = [{"title": f"Entity {i % 5000}", "text": " ".join(rng.choices(WORDS, weights, k=60))} for i in range(n_passages)]
    queries = [" ".join(rng.choices(WORDS, weights, k=6)) for _ in range(n_queries)]
    return passages, queries


def _timed_queries(search, queries: list[str], k: int) -> np.ndarray:
    """Wall seconds per query, in order."""
    return _timed_queries_cpu(search, queries, k)[0]


def _timed_queries_cpu(search, queries: list[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Wall seconds and process CPU seconds per query, in order.

    On a shared machine wall time includes waiting for a core; CPU time does not, so
    queries per CPU-second is what the method would do on an idle core.
    """
    wall, cpu = np.empty(len(queries)), np.empty(len(queries))
    for i, q in enumerate(queries):
        t0, c0 = time.perf_counter(), time.process_time()
        search(q, k=k)
        wall[i], cpu[i] = time.perf_counter() - t0, time.process_time() - c0
    return wall, cpu


def default_run(args: argparse.Namespace) -> None:
    from rank_bm25 import BM25Okapi

    from nemo_factuality.knowledge.legacy_fts5 import Fts5Store, build_fts5_store
    from nemo_factuality.knowledge.store import KnowledgeStore, build_store

    passages, queries = synth(args.passages, args.queries)
    rows = []  # (name, build s, per-query seconds)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "p.jsonl"
        src.write_text("".join(json.dumps(p) + "\n" for p in passages))
        t0 = time.perf_counter()
        store = KnowledgeStore(build_store(src, Path(tmp) / "kb.sqlite", progress=False))
        rows.append(("tantivy store (ours)", time.perf_counter() - t0, *_timed_queries_cpu(store.search, queries, args.k)))
        t0 = time.perf_counter()
        fts = Fts5Store(build_fts5_store(src, Path(tmp) / "fts5.sqlite"))
        rows.append(("SQLite FTS5 (old store)", time.perf_counter() - t0,
                     *_timed_queries_cpu(fts.search, queries[: args.fts_queries], args.k)))
        t0 = time.perf_counter()
        bm25 = BM25Okapi([p["text"].split() for p in passages])
        build = time.perf_counter() - t0
        rows.append(("rank_bm25 BM25Okapi", build, *_timed_queries_cpu(
            lambda q, k: bm25.get_scores(q.split()).argsort()[-k:], queries[: args.bm25_queries], args.k)))
        batched = _batched(store, queries * args.batch_repeat, args.k)
        store.close()

    ours, ours_cpu = rows[0][2], rows[0][3]
    print(f"passages={args.passages} queries={len(queries)} k={args.k} cores={len(os.sched_getaffinity(0))} "
          f"load(1m)={os.getloadavg()[0]:.1f}")
    print(f"{'':26}{'build s':>9}{'queries':>9}{'queries/s':>11}{'p50 ms':>8}{'p99 ms':>8}{'ours x':>9}"
          f"{'q/CPU-s':>10}{'ours x':>8}")
    for name, build, times, cpu in rows:
        ratio = times.sum() / ours[: len(times)].sum()
        print(f"{name:26}{build:>9.2f}{len(times):>9}{len(times) / times.sum():>11.1f}{np.percentile(times, 50) * 1e3:>8.2f}"
              f"{np.percentile(times, 99) * 1e3:>8.2f}{ratio:>8.1f}x{len(times) / cpu.sum():>10.1f}"
              f"{cpu.sum() / ours_cpu[: len(times)].sum():>7.1f}x")
    workers, n, seconds, cpu = batched
    print(f"batched search_batch on {workers} worker processes: {n} queries in {seconds:.2f} s = {n / seconds:.1f} "
          f"queries/s ({n / seconds / (len(ours) / ours.sum()):.2f}x one thread); CPU {cpu:.2f} s in all processes "
          f"= {n / cpu:.1f} q/CPU-s, so on {workers} idle cores ~{workers * n / cpu:.0f} queries/s")
    print("(ours x: how many times faster the store is on the same queries; q/CPU-s: queries per second of CPU, "
          "what one idle core would do; wall numbers include waiting for a core on a loaded machine)")


def _batched(store, queries: list[str], k: int) -> tuple[int, int, float, float]:
    """(workers, queries, wall seconds, CPU seconds of the parent and its worker processes)."""
    import psutil

    from nemo_factuality.knowledge.parallel import resolve_workers

    workers = resolve_workers(0)
    store.search_batch(queries[: 64 * workers], k=k, workers=workers)  # start the pool (spawn) outside the timing
    procs = [psutil.Process(), *psutil.Process().children(recursive=True)]

    def cpu() -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in procs))

    c0, t0 = cpu(), time.perf_counter()
    store.search_batch(queries, k=k, workers=workers)
    return workers, len(queries), time.perf_counter() - t0, cpu() - c0


# -- scale run -------------------------------------------------------------------------------------
def write_wiki_like(path: Path, n: int, words: int, vocab: int, seed: int = 0) -> int:
    """Stream ``n`` passages of ``words`` Zipf-distributed words (``vocab`` words) to JSONL; returns bytes."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
    cdf /= cdf[-1]
    names = np.array([f"w{i}" for i in range(vocab)])
    with open(path, "w", encoding="utf-8") as fh:
        for start in range(0, n, 10_000):
            m = min(10_000, n - start)
            ids = np.searchsorted(cdf, rng.random((m, words)))
            fh.writelines(json.dumps({"title": f"Article {(start + i) // 8}", "text": " ".join(row)}) + "\n"
                          for i, row in enumerate(names[ids]))
    return path.stat().st_size


def wiki_queries(n: int, vocab: int, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
    cdf /= cdf[-1]
    return [" ".join(f"w{i}" for i in row) for row in np.searchsorted(cdf, rng.random((n, 8)))]


def _child(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_child(src: str, out: str, heap_mb: int) -> None:
    from nemo_factuality.knowledge.store import build_store

    t0 = time.perf_counter()
    build_store(src, out, progress=False, heap_mb=heap_mb)
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in Path(out + ".bm25").rglob("*") if p.is_file())
    print(json.dumps({"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "index_mb": size / 1e6, "sqlite_mb": Path(out).stat().st_size / 1e6}))


def query_child(store_path: str, n_queries: int, vocab: int, k: int) -> None:
    from nemo_factuality.knowledge.store import KnowledgeStore

    t0 = time.perf_counter()
    store = KnowledgeStore(store_path)
    open_s = time.perf_counter() - t0
    queries = wiki_queries(n_queries, vocab)
    _timed_queries(store.search, queries[:50], k)  # touch the index pages once
    times, cpu = _timed_queries_cpu(store.search, queries, k)
    titled = _timed_queries(lambda q, k: store.search(q, k=k, title="Article 12345"), queries, k)
    exact = KnowledgeStore(store_path, verify=False, max_df_frac=1.0)  # every query term kept
    exact_wall, exact_cpu = _timed_queries_cpu(exact.search, queries, k)
    print(json.dumps({"open_s": open_s, "qps": len(times) / times.sum(), "q_per_cpu_s": len(times) / cpu.sum(),
                      "cpu_p99_ms": np.percentile(cpu, 99) * 1e3, "exact_q_per_cpu_s": len(queries) / exact_cpu.sum(),
                      "exact_p99_ms": np.percentile(exact_wall, 99) * 1e3,
                      "exact_cpu_p99_ms": np.percentile(exact_cpu, 99) * 1e3, "p50_ms": np.percentile(times, 50) * 1e3,
                      "p99_ms": np.percentile(times, 99) * 1e3, "title_p99_ms": np.percentile(titled, 99) * 1e3,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def scale_run(args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.scale.split(",")]
    print("(p50/p99: wall ms per query on one thread; CPU p99: CPU ms per query, free of waiting for a core; "
          "exact: the same queries with max_df_frac=1.0, every term kept)")
    print(f"scale: {args.words}-word passages, vocabulary {args.vocab}, heap {args.heap_mb} MB, {args.queries} "
          f"8-word queries, k={args.k}; cores={len(os.sched_getaffinity(0))}")
    print(f"{'passages':>10}{'input MB':>10}{'build s':>9}{'MB/s':>7}{'build RSS MB':>13}{'index MB':>10}{'sqlite MB':>10}"
          f"{'open s':>8}{'q/s':>8}{'q/CPU-s':>8}{'p50 ms':>8}{'p99 ms':>8}{'CPU p99':>8}{'title p99':>10}"
          f"{'exact q/CPU-s':>14}{'p99':>8}{'CPU p99':>8}{'load':>6}", flush=True)
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for n in sizes:
            src, out = Path(tmp) / f"p{n}.jsonl", str(Path(tmp) / f"kb{n}.sqlite")
            size = write_wiki_like(src, n, args.words, args.vocab)
            b = _child(["--_build-child", str(src), out, str(args.heap_mb)])
            src.unlink()
            q = _child(["--_query-child", out, str(args.queries), str(args.vocab), str(args.k)])
            print(f"{n:>10}{size / 1e6:>10.0f}{b['seconds']:>9.1f}{size / 1e6 / b['seconds']:>7.1f}{b['peak_rss_mb']:>13.0f}"
                  f"{b['index_mb']:>10.0f}{b['sqlite_mb']:>10.0f}{q['open_s']:>8.2f}{q['qps']:>8.0f}{q['q_per_cpu_s']:>8.0f}{q['p50_ms']:>8.2f}"
                  f"{q['p99_ms']:>8.2f}{q['cpu_p99_ms']:>8.2f}{q['title_p99_ms']:>10.2f}"
                  f"{q['exact_q_per_cpu_s']:>14.0f}{q['exact_p99_ms']:>8.2f}"
                  f"{q['exact_cpu_p99_ms']:>8.2f}{os.getloadavg()[0]:>6.1f}", flush=True)
            for p in Path(tmp).glob(f"kb{n}.sqlite*"):
                subprocess.run(["rm", "-rf", str(p)], check=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_build-child":
        return build_child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    if len(sys.argv) > 1 and sys.argv[1] == "--_query-child":
        return query_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passages", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=1_000)
    ap.add_argument("--fts-queries", type=int, default=300, help="queries the FTS5 baseline is timed on")
    ap.add_argument("--bm25-queries", type=int, default=100, help="queries rank_bm25 is timed on")
    ap.add_argument("--batch-repeat", type=int, default=4, help="the batched run answers the queries this many times")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--scale", default=None, help="comma-separated store sizes for the scale run")
    ap.add_argument("--words", type=int, default=100, help="scale run: words per passage")
    ap.add_argument("--vocab", type=int, default=200_000, help="scale run: vocabulary size")
    ap.add_argument("--heap-mb", type=int, default=256, help="scale run: the build's indexing memory budget")
    ap.add_argument("--tmp", default=None, help="scale run: where to write the stores (needs ~1.5 KB per passage)")
    args = ap.parse_args()
    scale_run(args) if args.scale else default_run(args)


if __name__ == "__main__":
    main()
