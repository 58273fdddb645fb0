"""The passage BM25 index on tantivy (Rust, Lucene-style): schema, query building, integrity manifest.

One index generation lives in ``<store>.bm25/<generation>/``; the SQLite file names the generation
it belongs to, so swapping the SQLite file swaps both at once (see ``store.py``).

Fields: ``id`` (the SQLite passage id, an i64 fast field read without touching the doc store),
``title_key`` (a digest of the exact title: title filtering is one term lookup, whatever the
title's length or characters), ``title`` and ``text`` (BM25, tantivy's ``default`` analyzer:
split on non-alphanumerics, drop tokens over 40 bytes, lowercase). No positions are indexed
(``freq``): every query here is a bag of terms, and the index is ~30% smaller without them.

Queries are built term by term from the same analysis the index used (``query_terms``), never
parsed from query syntax, so any user text is a valid query.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import tantivy

from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

INDEX_FORMAT = "tantivy-bm25-1"
TEXT_FIELDS = ("title", "text")
_CHUNK = 1 << 20
# The query-side twin of tantivy's "default" tokenizer, which the index uses for title and text.
_ANALYZER = (tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple()).filter(tantivy.Filter.remove_long(40))
             .filter(tantivy.Filter.lowercase()).build())


def schema() -> tantivy.Schema:
    sb = tantivy.SchemaBuilder()
    sb.add_integer_field("id", fast=True)
    sb.add_text_field("title_key", tokenizer_name="raw", index_option="basic")
    for name in TEXT_FIELDS:
        sb.add_text_field(name, tokenizer_name="default", index_option="freq")
    return sb.build()


SCHEMA = schema()


def title_key(title: str) -> str:
    """The exact-title filter term: a digest, so long or unusual titles stay one short term.

    A title that is not valid Unicode text (a lone surrogate) raises ``FactualityInputError``.
    """
    try:
        raw = title.encode("utf-8")
    except UnicodeEncodeError as err:
        raise FactualityInputError(f"title {title!r} is not valid Unicode text ({err.reason} at index {err.start}); "
                                   "pass the title as proper UTF-8") from None
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def query_terms(text: str) -> list[str]:
    """Distinct index terms of ``text`` in first-seen order (lone surrogates are dropped, not fatal)."""
    clean = text.encode("utf-8", "replace").decode("utf-8") if not text.isascii() else text
    return list(dict.fromkeys(_ANALYZER.analyze(clean)))


def document(pid: int, title: str, text: str) -> tantivy.Document:
    return tantivy.Document(id=pid, title_key=title_key(title), title=title, text=text)


def bm25_query(terms: Sequence[str], title: str | None) -> tantivy.Query:
    """OR of every term over title and text (BM25 summed), restricted to one exact title when given.

    The title filter scores 0, so scores are the same BM25 values with or without scoping.
    """
    should = [(tantivy.Occur.Should, tantivy.Query.term_query(SCHEMA, field, term, index_option="freq"))
              for term in terms for field in TEXT_FIELDS]
    query = tantivy.Query.boolean_query(should)
    if title is None:
        return query
    only_title = tantivy.Query.const_score_query(
        tantivy.Query.term_query(SCHEMA, "title_key", title_key(title), index_option="basic"), 0.0)
    return tantivy.Query.boolean_query([(tantivy.Occur.Must, query), (tantivy.Occur.Must, only_title)])


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def index_files(index_dir: Path) -> list[Path]:
    """The files that make up a committed index (tantivy's lock files excluded)."""
    return sorted(p for p in index_dir.iterdir() if p.is_file() and not p.name.endswith(".lock"))


def write_manifest(index_dir: Path) -> str:
    """JSON ``{file: [size, crc32]}`` of every index file, stored in the SQLite meta table."""
    return json.dumps({p.name: [p.stat().st_size, _crc32(p)] for p in index_files(index_dir)}, sort_keys=True)


def check_manifest(index_dir: Path, manifest: str, *, checksums: bool, rebuild_hint: str) -> None:
    """Raise ``FactualityInputError`` naming the first missing, resized or (with ``checksums``) altered file."""
    if not index_dir.is_dir():
        raise FactualityInputError(f"BM25 index directory {index_dir} is missing; {rebuild_hint}")
    for name, (size, crc) in json.loads(manifest).items():
        path = index_dir / name
        if not path.is_file():
            raise FactualityInputError(f"BM25 index file {path} is missing; {rebuild_hint}")
        if path.stat().st_size != size:
            raise FactualityInputError(f"BM25 index file {path} has {path.stat().st_size} bytes, expected {size} "
                                       f"(truncated or overwritten); {rebuild_hint}")
        if checksums and _crc32(path) != crc:
            raise FactualityInputError(f"BM25 index file {path} fails its CRC32 check (corrupted); {rebuild_hint}")


def open_searcher(index_dir: Path) -> tantivy.Searcher:
    """A searcher over the committed index; it never reloads (the index is immutable once built)."""
    index = tantivy.Index.open(str(index_dir))
    index.config_reader(reload_policy="Manual")
    return index.searcher()


def writer_for(index_dir: Path, heap_bytes: int, threads: int) -> tantivy.IndexWriter:
    os.makedirs(index_dir, exist_ok=True)
    return tantivy.Index(SCHEMA, path=str(index_dir)).writer(heap_size=heap_bytes, num_threads=threads)


def abandon(writer: tantivy.IndexWriter) -> None:
    """Drop uncommitted documents and wait for the writer's threads to stop (after a failed build)."""
    try:
        writer.rollback()
        writer.wait_merging_threads()
    except ValueError as err:  # already failing; the build's own error is the one to report
        log.warning("abandoning the BM25 writer: %s", err)
