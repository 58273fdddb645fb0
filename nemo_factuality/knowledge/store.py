"""The embedded knowledge store: passages and structured facts in SQLite, passage BM25 on tantivy.

No server: ``KnowledgeStore("kb.sqlite").search("born in Ulm", k=5, title="Albert Einstein")``.

On disk a store is two things that are swapped as one:

* ``kb.sqlite``: passages (id, title, text, source), facts, and a meta table naming the BM25
  index generation it belongs to, with that generation's file sizes and CRC32s;
* ``kb.sqlite.bm25/<generation>/``: the tantivy index (see ``bm25_index.py``).

Building streams the JSONL line by line into a temporary SQLite file and a fresh generation
directory; only when both are complete is the SQLite file renamed over ``kb.sqlite`` (an atomic
rename), so a store being built is invisible and a reader never sees a half-written index. A
reader keeps the SQLite file it opened, so a rebuild under it changes nothing it
answers. Opening verifies the index files against the manifest; a corrupted index is a clear error.

Passages JSONL: ``{"title": str, "text": str, "source"?: str}``.
Facts JSONL: ``{"subject": str, "relation": str, "value": str, "text"?: str}`` (``text`` is the
canonical sentence stating the fact; the exact verifier derives claim templates from it).
"""

from __future__ import annotations

import itertools
import json
import logging
import numbers
import os
import re
import shutil
import sqlite3
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from nemo_factuality.fileio import input_file
from nemo_factuality.jsonl import iter_jsonl
from nemo_factuality.knowledge import bm25_index
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

FACTSCORE_SEPARATOR = "####SPECIAL####SEPARATOR####"
STORE_FORMAT = "nemo-factuality-kb-2"
_WORD = re.compile(r"\w+", re.UNICODE)
_SCHEMA = """
CREATE TABLE passages (id INTEGER PRIMARY KEY, title TEXT NOT NULL, text TEXT NOT NULL, source TEXT);
CREATE INDEX passages_title ON passages(title);
CREATE TABLE facts (id INTEGER PRIMARY KEY, subject TEXT NOT NULL, relation TEXT NOT NULL, value TEXT NOT NULL,
                    text TEXT, subject_norm TEXT NOT NULL, relation_norm TEXT NOT NULL, value_norm TEXT NOT NULL);
CREATE INDEX facts_subject ON facts(subject_norm, relation_norm);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
"""
_FACT_INSERT = ("INSERT INTO facts(subject, relation, value, text, subject_norm, relation_norm, value_norm) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)")


def normalize(text: str) -> str:
    """Case-, whitespace- and punctuation-insensitive form used for fact matching."""
    return " ".join(_WORD.findall(text.casefold()))


def bm25_root(store_path: str | Path) -> Path:
    """The directory holding a store's BM25 index generations (``<store>.bm25``)."""
    return Path(str(store_path) + ".bm25")


def rebuild_hint(store_path: str | Path) -> str:
    return f"rebuild the store with 'nemo-factuality kb build ... --out {store_path}'"


@dataclass(frozen=True)
class Passage:
    id: int
    title: str
    text: str
    score: float  # BM25 relevance (higher is better)


@dataclass(frozen=True)
class Fact:
    subject: str
    relation: str
    value: str
    text: str | None


def clamp_k(k: object, n_passages: int) -> int:
    """``k`` as a result count in ``[0, n_passages]``; not an integer → ``FactualityInputError``.

    Any huge ``k`` (``2**63``) means "all of them": it is clamped, never passed on to overflow.
    """
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise FactualityInputError(f"k (number of passages to return) must be an integer, got {k!r}")
    return max(0, min(int(k), n_passages))


class KnowledgeStore:
    """Read-only access to a built store; safe to share across threads and processes.

    Threads share one tantivy searcher and one SQLite connection, both on the build that was
    current at open (a later rebuild does not change what this object answers). ``verify=True``
    checks every index file's CRC32 at open (reads the index once); ``False`` checks sizes only.

    ``max_df_frac``: on stores of at least ``min_passages_for_pruning`` passages, query terms that
    occur in more than this fraction of passages (stop words, in effect) are left out of the query;
    the rarest term is always kept. Such a term's BM25 IDF is at most ln(1 + 0.7/0.3) ≈ 1.2
    (informative terms: 5-15), yet it matches nearly every passage and dominates query time. ``1.0``
    keeps every term (exact BM25 over the whole query).
    """

    def __init__(self, path: str | Path, *, verify: bool = True, max_df_frac: float = 0.3,
                 min_passages_for_pruning: int = 1000) -> None:
        self.path = input_file(path, "knowledge store", suffixes=(".sqlite", ".db"),
                               hint="pass the store's SQLite file, as built by 'nemo-factuality kb build --passages "
                                    "F.jsonl --out kb.sqlite'")
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pool = None
        self._told_rebuilt = False
        if not 0.0 < max_df_frac <= 1.0:
            raise FactualityInputError(f"max_df_frac must be in (0, 1], got {max_df_frac}")
        self.max_df_frac, self.min_passages_for_pruning = max_df_frac, min_passages_for_pruning
        meta = self._open_and_read_meta()
        self.generation = meta["bm25_generation"]
        self.index_dir = bm25_root(self.path) / self.generation
        self._manifest = meta["bm25_manifest"]
        self.n_passages = int(meta["passages"])
        try:
            bm25_index.check_manifest(self.index_dir, self._manifest, checksums=verify, rebuild_hint=rebuild_hint(self.path))
            self._searcher = bm25_index.open_searcher(self.index_dir)
        except ValueError as err:  # tantivy reports unreadable index files as ValueError
            self.close()
            if isinstance(err, FactualityInputError):
                raise
            raise FactualityInputError(f"BM25 index {self.index_dir} cannot be opened ({err}); "
                                       f"{rebuild_hint(self.path)}") from None

    # -- opening -------------------------------------------------------------------------------
    def _open_and_read_meta(self) -> dict[str, str]:
        """Open the SQLite file and read its meta; retried if a rebuild swapped the file meanwhile.

        The one connection keeps the opened file (and so its index generation) for the store's
        life, even after a rebuild renames a new file over the path. It is shared by all threads
        under a lock: lookups take microseconds, and tantivy holds the GIL while searching anyway.
        """
        for _ in range(3):
            self.close()
            inode = os.stat(self.path).st_ino
            # immutable=1: stores are never modified in place (rebuilds replace the file); no locking on NFS.
            self._db = sqlite3.connect(f"file:{self.path}?mode=ro&immutable=1", uri=True, check_same_thread=False)
            meta = self._read_meta()
            self._inode = inode
            if os.stat(self.path).st_ino == inode and (bm25_root(self.path) / meta["bm25_generation"]).is_dir():
                break
            # A rebuild replaced the file while we opened it: open the new one.
        return meta

    def _query(self, sql: str, params: Sequence = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _read_meta(self) -> dict[str, str]:
        try:
            names = {r[0] for r in self._query("SELECT name FROM sqlite_master")}
            meta = dict(self._query("SELECT key, value FROM meta")) if "meta" in names else {}
        except sqlite3.DatabaseError as err:
            self.close()
            raise FactualityInputError(f"{self.path} is not a readable SQLite knowledge store: {err}") from None
        if "passages_fts" in names and "bm25_generation" not in meta:
            self.close()
            raise FactualityInputError(
                f"{self.path} is a knowledge store in the old SQLite-FTS5 format; migrate it once with "
                f"'nemo-factuality kb migrate --kb {self.path}' (moves BM25 to tantivy, keeps passage ids and facts)")
        missing = {"passages", "facts", "meta"} - names
        if missing or meta.get("format") != STORE_FORMAT:
            self.close()
            raise FactualityInputError(f"{self.path} is not a nemo_factuality knowledge store (missing tables "
                                       f"{sorted(missing)}, format {meta.get('format')!r}); {rebuild_hint(self.path)}")
        return meta

    # -- readiness -----------------------------------------------------------------------------
    def health(self) -> str | None:
        """None when the store answers a query, else the reason (missing file, broken index or database)."""
        try:
            if not self.path.is_file():
                return (f"knowledge store {self.path} no longer exists (deleted or moved): this process still answers "
                        "from the copy it opened, but a restart would fail; restore or rebuild it")
            if os.stat(self.path).st_ino == self._inode:
                bm25_index.check_manifest(self.index_dir, self._manifest, checksums=False, rebuild_hint=rebuild_hint(self.path))
            elif not self._told_rebuilt:  # still healthy: this object serves the build it opened, consistently
                log.info("knowledge store %s was rebuilt since it was opened; restart to serve the new build", self.path)
                self._told_rebuilt = True
            self._query("SELECT id FROM passages LIMIT 1")
            self._searcher.search(bm25_index.bm25_query(["a"], None), 1, count=False)
            return None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # noqa: BLE001 - a probe must answer; tantivy panics are BaseExceptions
            return f"knowledge store {self.path}: {type(err).__name__}: {err}"

    def count(self) -> tuple[int, int]:
        """(number of passages, number of facts)."""
        return self._query("SELECT count(*) FROM passages")[0][0], self._query("SELECT count(*) FROM facts")[0][0]

    # -- passages ------------------------------------------------------------------------------
    def search(self, query: str, k: int = 5, title: str | None = None) -> list[Passage]:
        """Top-``k`` passages by BM25 over title and text, best first, optionally only one exact ``title``.

        Any text is a valid query (no query syntax); a query with no indexable word returns ``[]``.
        ``k`` is clamped to the number of passages; a ``title`` that is not valid Unicode raises
        ``FactualityInputError``.
        """
        k = clamp_k(k, self.n_passages)
        if title is not None:
            bm25_index.title_key(title)  # validates before any work
        terms = self._informative_terms(bm25_index.query_terms(query))
        if k == 0 or not terms:
            return []
        hits = self._searcher.search(bm25_index.bm25_query(terms, title), k, count=False).hits
        if not hits:
            return []
        ids = self._searcher.fast_field_values("id", [addr for _, addr in hits])
        rows = self._rows(ids)
        return [Passage(pid, *rows[pid], float(score)) for pid, (score, _) in zip(ids, hits)]

    def _informative_terms(self, terms: list[str]) -> list[str]:
        """``terms`` without those in more than ``max_df_frac`` of passages (the rarest always stays)."""
        if len(terms) <= 1 or self.max_df_frac >= 1.0 or self.n_passages < self.min_passages_for_pruning:
            return terms
        df = {t: self._searcher.doc_freq("text", t) for t in terms}
        limit = self.max_df_frac * self.n_passages
        return [t for t in terms if df[t] <= limit] or [min(terms, key=df.__getitem__)]

    def search_batch(self, queries: Sequence[str], k: int = 5, titles: Sequence[str | None] | None = None,
                     workers: int | None = 1) -> list[list[Passage]]:
        """``search`` for many queries; ``workers`` processes (None or 0: every core) for large batches.

        tantivy holds the GIL while it searches, so threads cannot add cores; worker processes each
        open this same read-only store once and are kept for later batches.
        """
        from nemo_factuality.knowledge.parallel import resolve_workers, search_serial

        k = clamp_k(k, self.n_passages)
        titles = list(titles) if titles is not None else [None] * len(queries)
        if len(titles) != len(queries):
            raise FactualityInputError(f"search_batch got {len(queries)} queries but {len(titles)} titles; pass one "
                                       "title (or None) per query")
        workers = resolve_workers(workers)
        if workers <= 1 or len(queries) < 32 * workers:
            return search_serial(self, queries, k, titles)
        if self._pool is None or self._pool.workers != workers:
            from nemo_factuality.knowledge.parallel import SearchPool

            if self._pool is not None:
                self._pool.close()
            self._pool = SearchPool(type(self), self.path, self.generation, workers, {
                "max_df_frac": self.max_df_frac, "min_passages_for_pruning": self.min_passages_for_pruning})
        return [[Passage(*row) for row in hits] for hits in self._pool.search(queries, k, titles)]

    def _rows(self, ids: Sequence[int]) -> dict[int, tuple[str, str]]:
        out: dict[int, tuple[str, str]] = {}
        for i in range(0, len(ids), 500):  # SQLite caps the number of bound parameters
            chunk = list(ids[i:i + 500])
            rows = self._query(f"SELECT id, title, text FROM passages WHERE id IN ({','.join('?' * len(chunk))})", chunk)
            out.update((pid, (title, text)) for pid, title, text in rows)
        return out

    def passages_by_id(self, ids: Sequence[int]) -> dict[int, tuple[str, str]]:
        """``{id: (title, text)}`` for the ids that exist."""
        return self._rows(ids) if ids else {}

    def passages_for_title(self, title: str) -> list[Passage]:
        rows = self._query("SELECT id, title, text FROM passages WHERE title = ? ORDER BY id", (title,))
        return [Passage(i, t, x, 0.0) for i, t, x in rows]

    # -- facts ---------------------------------------------------------------------------------
    def facts_about(self, subject: str, relation: str | None = None) -> list[Fact]:
        sql = "SELECT subject, relation, value, text FROM facts WHERE subject_norm = ?"
        params = [normalize(subject)]
        if relation is not None:
            sql += " AND relation_norm = ?"
            params.append(normalize(relation))
        return [Fact(*row) for row in self._query(sql, params)]

    def all_facts(self) -> Iterator[Fact]:
        yield from (Fact(*row) for row in self._query("SELECT subject, relation, value, text FROM facts ORDER BY id"))

    def close(self) -> None:
        """Close the database connection and any search worker processes."""
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


# -- building ----------------------------------------------------------------------------------
def _check_text(where: str, obj: dict, fields: Iterable[str]) -> None:
    for key in fields:
        value = obj.get(key)
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise FactualityInputError(f"{where}: field {key!r} holds a lone surrogate escape (e.g. \\ud800), "
                                           "which is not text; fix or drop that line") from None


def _iter_valid(path: Path, required: tuple[str, ...], optional: tuple[str, ...]) -> Iterator[dict]:
    for where, obj in iter_jsonl(path):
        missing = [k for k in required if not isinstance(obj.get(k), str) or not obj.get(k).strip()]
        if missing:
            raise FactualityInputError(f"{where}: field(s) {missing} missing or not a non-empty string")
        _check_text(where, obj, required + optional)
        yield obj


def jsonl_passages(path: Path) -> Iterator[tuple[int | None, str, str, str | None]]:
    """``(id, title, text, source)`` rows of a passages JSONL (ids assigned by the builder)."""
    for o in _iter_valid(path, ("title", "text"), ("source",)):
        yield None, o["title"], o["text"], o.get("source") if isinstance(o.get("source"), str) else None


def jsonl_facts(path: Path) -> Iterator[tuple[str, str, str, str | None]]:
    for o in _iter_valid(path, ("subject", "relation", "value"), ("text",)):
        yield o["subject"], o["relation"], o["value"], o.get("text") if isinstance(o.get("text"), str) else None


def _load_passages(conn: sqlite3.Connection, writer, rows: Iterable[tuple], batch_size: int, progress: bool) -> int:
    """Insert passages into SQLite and the BM25 writer; ids are kept when given, else 1, 2, ..."""
    n, next_id, batch = 0, 1, []
    with tqdm(desc="passages", unit="psg", disable=not progress) as bar:
        for pid, title, text, source in rows:
            pid = next_id if pid is None else int(pid)
            next_id = pid + 1
            writer.add_document(bm25_index.document(pid, title, text))
            batch.append((pid, title, text, source))
            if len(batch) >= batch_size:
                conn.executemany("INSERT INTO passages(id, title, text, source) VALUES (?, ?, ?, ?)", batch)
                n += len(batch)
                bar.update(len(batch))
                batch.clear()
        conn.executemany("INSERT INTO passages(id, title, text, source) VALUES (?, ?, ?, ?)", batch)
        bar.update(len(batch))
    return n + len(batch)


def _load_facts(conn: sqlite3.Connection, rows: Iterable[tuple], batch_size: int) -> int:
    n, batch = 0, []
    for subject, relation, value, text in rows:
        batch.append((subject, relation, value, text, normalize(subject), normalize(relation), normalize(value)))
        if len(batch) >= batch_size:
            conn.executemany(_FACT_INSERT, batch)
            n += len(batch)
            batch.clear()
    conn.executemany(_FACT_INSERT, batch)
    return n + len(batch)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_store(out_path: str | Path, passages: Iterable[tuple], facts: Iterable[tuple] = (), *,
                batch_size: int = 10_000, progress: bool = True, heap_mb: int = 256, threads: int | None = None,
                source: str = "the passages given") -> Path:
    """Write a new store at ``out_path`` from ``(id | None, title, text, source)`` passage rows and
    ``(subject, relation, value, text | None)`` fact rows; swapped in atomically when complete. No passage
    at all is a ``FactualityInputError`` naming ``source`` (a store that finds nothing is never a result).

    Memory is bounded by ``heap_mb`` (tantivy's indexing buffer) plus ``batch_size`` rows, whatever
    the number of passages. Older index generations of the same store are removed after the swap.
    """
    if heap_mb < 16:
        raise FactualityInputError(f"heap_mb must be >= 16 (tantivy needs a few MB per indexing thread), got {heap_mb}")
    passages = iter(passages)
    first = next(passages, None)  # before anything is created
    if first is None:
        raise FactualityInputError(f"{source} has no passages: a knowledge store needs at least one "
                                   '{"title", "text"} line')
    passages = itertools.chain([first], passages)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    generation = uuid.uuid4().hex
    root = bm25_root(out)
    building, final = root / f".building-{generation}", root / generation
    tmp = out.with_name(f".{out.name}.building-{generation}")
    threads = threads or min(4, len(os.sched_getaffinity(0)))
    conn, writer = sqlite3.connect(tmp), None
    try:
        conn.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;" + _SCHEMA)
        writer = bm25_index.writer_for(building, heap_mb * 1_000_000, threads)
        n_pass = _load_passages(conn, writer, passages, batch_size, progress)
        log.info("committing and merging the BM25 index of %d passages", n_pass)
        writer.commit()
        writer, merging = None, writer
        merging.wait_merging_threads()  # consumes the writer
        n_facts = _load_facts(conn, facts, batch_size)
        os.rename(building, final)
        conn.executemany("INSERT INTO meta VALUES (?, ?)", [
            ("format", STORE_FORMAT), ("bm25_format", bm25_index.INDEX_FORMAT), ("bm25_generation", generation),
            ("bm25_manifest", bm25_index.write_manifest(final)), ("passages", str(n_pass)), ("facts", str(n_facts))])
        conn.commit()
        conn.close()
        _fsync(tmp)
        os.replace(tmp, out)  # the commit point: readers opening the path now see the complete new store
    except BaseException:
        conn.close()
        if writer is not None:  # stop its indexing threads before deleting what they write
            bm25_index.abandon(writer)
        tmp.unlink(missing_ok=True)
        shutil.rmtree(building, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        if root.is_dir() and not any(root.iterdir()):
            root.rmdir()  # a first build that failed leaves nothing behind
        raise
    _drop_old_generations(root, keep=generation)
    log.info("built %s: %d passages, %d facts", out, n_pass, n_facts)
    return out


def _drop_old_generations(root: Path, keep: str) -> None:
    """Remove finished generations other than ``keep`` (open readers keep their mapped files; see README)."""
    for entry in root.iterdir():
        if entry.is_dir() and entry.name != keep and not entry.name.startswith("."):
            shutil.rmtree(entry, ignore_errors=True)


def build_store(passages_jsonl: str | Path, out_path: str | Path, *, facts_jsonl: str | Path | None = None,
                batch_size: int = 10_000, progress: bool = True, heap_mb: int = 256, threads: int | None = None) -> Path:
    """Stream passages (and facts) from JSONL into a new store at ``out_path`` (atomic swap)."""
    facts = jsonl_facts(Path(facts_jsonl)) if facts_jsonl is not None else ()
    return write_store(out_path, jsonl_passages(Path(passages_jsonl)), facts, batch_size=batch_size,
                       progress=progress, heap_mb=heap_mb, threads=threads, source=str(passages_jsonl))


def docdb_to_jsonl(docdb_path: str | Path, out_jsonl: str | Path) -> int:
    """Convert a FActScore ``documents(title, text)`` DB (passages joined by the separator) to passages JSONL.

    A file that is not SQLite, or a database without that table (or those columns), is a ``FactualityInputError``."""
    src = sqlite3.connect(f"{Path(docdb_path).resolve().as_uri()}?mode=ro", uri=True)
    n = 0
    try:
        with open(out_jsonl, "w", encoding="utf-8") as fh:
            for title, text in src.execute("SELECT title, text FROM documents"):
                for passage in (text or "").split(FACTSCORE_SEPARATOR):
                    if passage.strip():
                        fh.write(json.dumps({"title": title, "text": passage.strip(), "source": "factscore_docdb"}) + "\n")
                        n += 1
    except sqlite3.DatabaseError as err:
        raise FactualityInputError(f"{docdb_path} is not a FActScore database ({err}): pass the SQLite file with its "
                                   "documents(title, text) table, e.g. enwiki-20230401.db") from None
    finally:
        src.close()
    return n
