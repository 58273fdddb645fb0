"""The previous store layout (BM25 in SQLite FTS5): migration to the tantivy store, and a baseline.

``migrate_fts5_store`` turns an FTS5 store into the current format in place (atomic swap), keeping
passage ids (so a dense FAISS index built on it stays valid) and facts. ``Fts5Store`` answers
queries exactly as the old store did, and ``build_fts5_store`` writes one: the retrieval benchmark
measures the new store against it in the same run, and the migration test starts from it.
"""

from __future__ import annotations

import logging
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from nemo_factuality.knowledge import store as kb
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

_WORD = re.compile(r"\w+", re.UNICODE)
FTS5_SCHEMA = """
CREATE TABLE passages (id INTEGER PRIMARY KEY, title TEXT NOT NULL, text TEXT NOT NULL, source TEXT);
CREATE INDEX passages_title ON passages(title);
CREATE VIRTUAL TABLE passages_fts USING fts5(title, text, content='passages', content_rowid='id',
                                             tokenize='unicode61');
CREATE VIRTUAL TABLE passages_vocab USING fts5vocab(passages_fts, 'row');
CREATE TABLE facts (id INTEGER PRIMARY KEY, subject TEXT NOT NULL, relation TEXT NOT NULL, value TEXT NOT NULL,
                    text TEXT, subject_norm TEXT NOT NULL, relation_norm TEXT NOT NULL, value_norm TEXT NOT NULL);
CREATE INDEX facts_subject ON facts(subject_norm, relation_norm);
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT);
"""


def build_fts5_store(passages_jsonl: str | Path, out_path: str | Path, *, facts_jsonl: str | Path | None = None,
                     batch_size: int = 10_000) -> Path:
    """Write a store in the old FTS5 layout (baseline and migration source; not for new stores)."""
    out = Path(out_path)
    out.unlink(missing_ok=True)
    conn = sqlite3.connect(out)
    try:
        conn.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;" + FTS5_SCHEMA)
        rows = ((t, x, s) for _, t, x, s in kb.jsonl_passages(Path(passages_jsonl)))
        _insert(conn, "INSERT INTO passages(title, text, source) VALUES (?, ?, ?)", rows, batch_size)
        conn.execute("INSERT INTO passages_fts(passages_fts) VALUES('rebuild')")
        if facts_jsonl is not None:
            facts = ((s, r, v, t, kb.normalize(s), kb.normalize(r), kb.normalize(v))
                     for s, r, v, t in kb.jsonl_facts(Path(facts_jsonl)))
            _insert(conn, kb._FACT_INSERT, facts, batch_size)
        conn.commit()
    finally:
        conn.close()
    return out


def _insert(conn: sqlite3.Connection, sql: str, rows: Iterator[tuple], batch_size: int) -> None:
    batch: list[tuple] = []
    for row in rows:
        batch.append(row)
        if len(batch) >= batch_size:
            conn.executemany(sql, batch)
            batch.clear()
    conn.executemany(sql, batch)


def is_fts5_store(path: str | Path) -> bool:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        generation = conn.execute("SELECT value FROM meta WHERE key = 'bm25_generation'").fetchall() if "meta" in names else []
    except sqlite3.DatabaseError as err:
        raise FactualityInputError(f"{path} is not a readable SQLite knowledge store: {err}") from None
    finally:
        conn.close()
    return "passages_fts" in names and not generation


def migrate_fts5_store(path: str | Path, *, progress: bool = True) -> Path:
    """Rewrite an FTS5 store at ``path`` in the current format (same passage ids and facts; atomic swap)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"knowledge store {path} does not exist")
    if not is_fts5_store(path):
        raise FactualityInputError(f"{path} is not an FTS5-format knowledge store (already migrated, or not a store); "
                                   "nothing to migrate")
    src = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        passages = src.execute("SELECT id, title, text, source FROM passages ORDER BY id")
        facts = src.cursor().execute("SELECT subject, relation, value, text FROM facts ORDER BY id")
        kb.write_store(path, passages, facts, progress=progress)
    finally:
        src.close()
    if Path(str(path) + ".faiss").is_file():  # ids were kept, so a dense index built on the old store stays valid
        from nemo_factuality.knowledge.dense import write_dense_meta

        write_dense_meta(path)
    log.info("migrated %s from SQLite FTS5 to the tantivy BM25 index", path)
    return path


class Fts5Store:
    """The old store's query path, verbatim in behaviour: OR of the query's words over FTS5 ``bm25()``,
    dropping words in more than ``max_df_frac`` of passages once there are ``min_passages_for_pruning``."""

    def __init__(self, path: str | Path, max_df_frac: float = 0.3, min_passages_for_pruning: int = 1000) -> None:
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        self.max_df_frac, self.min_passages = max_df_frac, min_passages_for_pruning
        self.n = self.conn.execute("SELECT count(*) FROM passages").fetchone()[0]

    def _informative_terms(self, query: str) -> list[str]:
        words = list(dict.fromkeys(w.casefold() for w in _WORD.findall(query)))
        if len(words) <= 1 or self.n < self.min_passages:
            return words
        marks = ",".join("?" * len(words))
        df = dict(self.conn.execute(f"SELECT term, doc FROM passages_vocab WHERE term IN ({marks})", words).fetchall())
        kept = [w for w in words if df.get(w, 0) <= self.max_df_frac * self.n]
        return kept or [min(words, key=lambda w: df.get(w, 0))]

    def search(self, query: str, k: int = 5, title: str | None = None) -> list[kb.Passage]:
        words = self._informative_terms(query)
        if not words or k <= 0:
            return []
        sql = ("SELECT p.id, p.title, p.text, bm25(passages_fts) AS s FROM passages_fts "
               "JOIN passages p ON p.id = passages_fts.rowid WHERE passages_fts MATCH ?")
        params: list = [" OR ".join('"' + w.replace('"', '""') + '"' for w in words)]
        if title is not None:
            sql += " AND p.title = ?"
            params.append(title)
        params.append(int(k))
        return [kb.Passage(i, t, x, -s) for i, t, x, s in self.conn.execute(sql + " ORDER BY s LIMIT ?", params)]
