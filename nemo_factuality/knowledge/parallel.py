"""Batched BM25 search on every core: worker processes that each open the same read-only store.

tantivy's Python binding holds the GIL while it searches, so a thread pool would run one search
at a time; processes do not share a GIL. Each worker opens the store once (its index files are
memory-mapped, so the page cache is shared, not copied) and checks that it opened the same
generation as the parent, so a rebuild between the two opens is an error, not mixed results.
Results come back as plain tuples over the pool's pipe (between our own processes); the store turns them into its
passages. This module knows the store only as the class it is handed (pickled by name for the workers), so the store
can import it without a loop.

Workers are started with ``spawn`` (safe in threaded servers), which re-imports the main module:
a script that calls ``search_batch`` with ``workers != 1`` needs the usual
``if __name__ == "__main__":`` guard, as with any multiprocessing code.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

_STORE = None  # the worker process's store, opened by _open_in_worker


def resolve_workers(workers: int | None) -> int:
    """``None`` or ``0`` → the cores this process may use; otherwise ``workers`` (must be >= 0)."""
    if workers is None or workers == 0:
        return len(os.sched_getaffinity(0))
    if workers < 0:
        raise FactualityInputError(f"workers must be >= 0 (0 or None = every core), got {workers}")
    return int(workers)


def search_serial(store, queries: Sequence[str], k: int, titles: Sequence[str | None]) -> list:
    return [store.search(q, k=k, title=t) for q, t in zip(queries, titles)]


def _exit_with(parent: int, poll_s: float = 1.0) -> None:
    """In a worker: end this process within ``poll_s`` of ``parent`` ending, however it ended (a SIGKILL, a SIGTERM
    that stopped the command before the pool's shutdown). A spawned pool's workers each hold both ends of its call
    queue, so a dead parent leaves them blocked on it forever: orphans holding the store open."""
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _open_in_worker(parent: int, store_class: type, path: str, generation: str, options: dict) -> None:
    global _STORE
    from nemo_factuality.stopping import ignore_stop_signals_in_workers

    ignore_stop_signals_in_workers()  # Ctrl-C reaches the whole process group: the parent stops the pool
    _exit_with(parent)  # the parent's pid as it gave it: a worker still starting when its parent died sees PID 1 here
    # The parent already verified checksums; sizes are enough here.
    _STORE = store_class(path, verify=False, **options)
    if _STORE.generation != generation:
        raise FactualityInputError(f"knowledge store {path} was rebuilt while search workers started "
                                   f"(generation {_STORE.generation}, parent has {generation}); reopen the store")


def _search_chunk(chunk: list[tuple[str, str | None]], k: int) -> list[list[tuple]]:
    return [[(p.id, p.title, p.text, p.score) for p in _STORE.search(q, k=k, title=t)] for q, t in chunk]


class SearchPool:
    """A persistent pool of ``workers`` search processes over one store generation."""

    def __init__(self, store_class: type, path: Path, generation: str, workers: int, options: dict) -> None:
        """``store_class(path, verify=False, **options)`` opens the store in a worker; ``options``: the parent store's
        query options, so workers answer exactly as it would."""
        self.workers = workers
        # spawn, not fork: the parent may be a threaded server, and forking threads is unsafe.
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_open_in_worker,
                                         initargs=(os.getpid(), store_class, str(path), generation, options))
        log.info("started %d BM25 search worker processes for %s", workers, path)

    def search(self, queries: Sequence[str], k: int, titles: Sequence[str | None]) -> list[list[tuple]]:
        """Per query, its hits as ``(id, title, text, score)`` rows, in query order."""
        pairs = list(zip(queries, titles))
        size = max(8, -(-len(pairs) // (self.workers * 4)))  # ~4 chunks per worker balances uneven queries
        chunks = [pairs[i:i + size] for i in range(0, len(pairs), size)]
        out: list[list[tuple]] = []
        for result in self._pool.map(_search_chunk, chunks, [k] * len(chunks)):
            out.extend(result)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
