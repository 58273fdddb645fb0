"""The embedded knowledge store: passages in SQLite with an FTS5 BM25 index, plus structured facts.

One file, no server: ``KnowledgeStore("kb.sqlite").search("born in Ulm", k=5, title="Albert Einstein")``.
Building streams the JSONL line by line (millions of passages never sit in memory) and writes
to a temporary file that is renamed into place only when complete.

Passages JSONL: ``{"title": str, "text": str, "source"?: str}``.
Facts JSONL: ``{"subject": str, "relation": str, "value": str, "text"?: str}`` (``text`` is the
canonical sentence stating the fact; the exact verifier derives claim templates from it).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from tqdm import tqdm

from nemo_factuality.jsonl import iter_jsonl
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

FACTSCORE_SEPARATOR = "####SPECIAL####SEPARATOR####"
_WORD = re.compile(r"\w+", re.UNICODE)
_SCHEMA = """
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


def normalize(text: str) -> str:
    """Case-, whitespace- and punctuation-insensitive form used for fact matching."""
    return " ".join(_WORD.findall(text.casefold()))


def fts_query(text: str) -> str | None:
    """An FTS5 query that ORs the words of arbitrary user text (never a syntax error)."""
    words = _WORD.findall(text)
    if not words:
        return None
    return " OR ".join('"' + w.replace('"', '""') + '"' for w in dict.fromkeys(words))


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


class KnowledgeStore:
    """Read-only access to a built store; safe to share across threads (one connection per thread)."""

    def __init__(self, path: str | Path, max_df_frac: float = 0.3, min_passages_for_pruning: int = 1000) -> None:
        self.path = Path(path)
        self.max_df_frac, self.min_passages_for_pruning = max_df_frac, min_passages_for_pruning
        self._count: int | None = None
        if not self.path.is_file():
            raise FileNotFoundError(f"knowledge store {self.path} does not exist; build it with "
                                    "'nemo-factuality kb build --passages F.jsonl --out kb.sqlite'")
        self._local = threading.local()
        self._check_schema()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            self._local.conn = conn
        return conn

    def _check_schema(self) -> None:
        try:
            names = {r[0] for r in self._conn().execute("SELECT name FROM sqlite_master")}
        except sqlite3.DatabaseError as err:
            raise FactualityInputError(f"{self.path} is not a readable SQLite knowledge store: {err}") from None
        missing = {"passages", "passages_fts", "passages_vocab", "facts"} - names
        if missing:
            raise FactualityInputError(f"{self.path} is not a nemo_factuality knowledge store (missing tables {sorted(missing)})")

    def health(self) -> str | None:
        """None when the store answers a query, else the reason."""
        try:
            self._conn().execute("SELECT count(*) FROM passages").fetchone()
            return None
        except sqlite3.Error as err:
            return f"knowledge store {self.path}: {err}"

    def count(self) -> tuple[int, int]:
        """(number of passages, number of facts)."""
        c = self._conn()
        return c.execute("SELECT count(*) FROM passages").fetchone()[0], c.execute("SELECT count(*) FROM facts").fetchone()[0]

    def _informative_terms(self, query: str) -> str:
        """Drop terms that occur in more than ``max_df_frac`` of passages (stop words, in effect).

        Such terms carry almost no BM25 weight (their IDF is near zero or floored) but make an OR
        query touch nearly every row; dropping them keeps queries fast on millions of passages.
        The rarest term is always kept.
        """
        words = list(dict.fromkeys(w.casefold() for w in _WORD.findall(query)))
        if len(words) <= 1 or self._n_passages() < self.min_passages_for_pruning:
            return " ".join(words)
        conn = self._conn()
        marks = ",".join("?" * len(words))
        df = dict(conn.execute(f"SELECT term, doc FROM passages_vocab WHERE term IN ({marks})", words).fetchall())
        limit = self.max_df_frac * self._n_passages()
        kept = [w for w in words if df.get(w, 0) <= limit]
        return " ".join(kept or [min(words, key=lambda w: df.get(w, 0))])

    def _n_passages(self) -> int:
        if self._count is None:
            self._count = self._conn().execute("SELECT count(*) FROM passages").fetchone()[0]
        return self._count

    def search(self, query: str, k: int = 5, title: str | None = None) -> list[Passage]:
        """Top-``k`` passages by BM25, optionally only those of one ``title`` (FActScore/KnowRL style)."""
        match = fts_query(self._informative_terms(query))
        if match is None or k <= 0:
            return []
        sql = ("SELECT p.id, p.title, p.text, bm25(passages_fts) AS s FROM passages_fts "
               "JOIN passages p ON p.id = passages_fts.rowid WHERE passages_fts MATCH ?")
        params: list = [match]
        if title is not None:
            sql += " AND p.title = ?"
            params.append(title)
        sql += " ORDER BY s LIMIT ?"
        params.append(int(k))
        # SQLite's bm25() is lower-is-better; negate so callers see higher-is-better scores.
        return [Passage(i, t, x, -s) for i, t, x, s in self._conn().execute(sql, params)]

    def passages_for_title(self, title: str) -> list[Passage]:
        rows = self._conn().execute("SELECT id, title, text FROM passages WHERE title = ? ORDER BY id", (title,))
        return [Passage(i, t, x, 0.0) for i, t, x in rows]

    def facts_about(self, subject: str, relation: str | None = None) -> list[Fact]:
        sql = "SELECT subject, relation, value, text FROM facts WHERE subject_norm = ?"
        params = [normalize(subject)]
        if relation is not None:
            sql += " AND relation_norm = ?"
            params.append(normalize(relation))
        return [Fact(*row) for row in self._conn().execute(sql, params)]

    def all_facts(self) -> Iterator[Fact]:
        for row in self._conn().execute("SELECT subject, relation, value, text FROM facts ORDER BY id"):
            yield Fact(*row)

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None


def _iter_jsonl(path: Path, required: tuple[str, ...]) -> Iterator[dict]:
    for where, obj in iter_jsonl(path):
        missing = [k for k in required if not isinstance(obj.get(k), str) or not obj.get(k).strip()]
        if missing:
            raise FactualityInputError(f"{where}: field(s) {missing} missing or not a non-empty string")
        yield obj


def _insert_batches(conn: sqlite3.Connection, sql: str, rows: Iterator[tuple], batch_size: int, bar: tqdm) -> int:
    n, batch = 0, []
    for row in rows:
        batch.append(row)
        if len(batch) >= batch_size:
            conn.executemany(sql, batch)
            n += len(batch)
            bar.update(len(batch))
            batch.clear()
    if batch:
        conn.executemany(sql, batch)
        n += len(batch)
        bar.update(len(batch))
    return n


def build_store(passages_jsonl: str | Path, out_path: str | Path, *, facts_jsonl: str | Path | None = None,
                batch_size: int = 10_000, progress: bool = True) -> Path:
    """Stream passages (and facts) from JSONL into a new store at ``out_path`` (atomic rename)."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.building")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    try:
        conn.executescript("PRAGMA journal_mode=OFF; PRAGMA synchronous=OFF;" + _SCHEMA)
        with tqdm(desc="passages", unit="psg", disable=not progress) as bar:
            rows = ((o["title"], o["text"], o.get("source")) for o in _iter_jsonl(Path(passages_jsonl), ("title", "text")))
            n_pass = _insert_batches(conn, "INSERT INTO passages(title, text, source) VALUES (?, ?, ?)", rows, batch_size, bar)
        log.info("indexing %d passages (FTS5)", n_pass)
        conn.execute("INSERT INTO passages_fts(passages_fts) VALUES('rebuild')")
        n_facts = 0
        if facts_jsonl is not None:
            with tqdm(desc="facts", unit="fact", disable=not progress) as bar:
                rows = ((o["subject"], o["relation"], o["value"], o.get("text"), normalize(o["subject"]),
                         normalize(o["relation"]), normalize(o["value"]))
                        for o in _iter_jsonl(Path(facts_jsonl), ("subject", "relation", "value")))
                n_facts = _insert_batches(conn, "INSERT INTO facts(subject, relation, value, text, subject_norm, "
                                          "relation_norm, value_norm) VALUES (?, ?, ?, ?, ?, ?, ?)", rows, batch_size, bar)
        conn.executemany("INSERT INTO meta VALUES (?, ?)", [("passages", str(n_pass)), ("facts", str(n_facts))])
        conn.commit()
        conn.close()
        os.replace(tmp, out)
    except BaseException:
        conn.close()
        tmp.unlink(missing_ok=True)
        raise
    log.info("built %s: %d passages, %d facts", out, n_pass, n_facts)
    return out


def docdb_to_jsonl(docdb_path: str | Path, out_jsonl: str | Path) -> int:
    """Convert a FActScore ``documents(title, text)`` DB (passages joined by the separator) to passages JSONL."""
    src = sqlite3.connect(f"file:{docdb_path}?mode=ro", uri=True)
    n = 0
    try:
        with open(out_jsonl, "w", encoding="utf-8") as fh:
            for title, text in src.execute("SELECT title, text FROM documents"):
                for passage in text.split(FACTSCORE_SEPARATOR):
                    if passage.strip():
                        fh.write(json.dumps({"title": title, "text": passage.strip(), "source": "factscore_docdb"}) + "\n")
                        n += 1
    finally:
        src.close()
    return n
