"""Evidence providers (registered in ``EVIDENCE``): where a verifier's passages come from.

* ``none``: no evidence (KLCF's online truthfulness verifier judges from its own knowledge).
* ``given``: the sample's own materials column (FSPO's ``knowledge`` paragraph).
* ``bm25_sections``: RLFH — materials chunked into <= 64-word sections, BM25 top-3 with score > 0.
* ``kb``: the embedded knowledge store, title-scoped when the sample has a topic (FActScore/KnowRL).
* ``kb_hybrid``: the store's BM25 and dense rankings fused by reciprocal rank (needs ``kb build --dense``).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

from nemo_factuality.interfaces import EvidenceQuery
from nemo_factuality.registry import EVIDENCE
from nemo_factuality.text.segment import split_sentences
from nemo_factuality.types import FactualityInputError

_TOKEN = re.compile(r"\w+")
# A small English stop-word list (RLFH filters stop words before BM25).
_STOP = frozenset("a an the of in on at to for and or but is are was were be been by with as from that this it its "
                  "he she they his her their who what which when where how".split())


@EVIDENCE.register("none")
class NullEvidence:
    def get_batch(self, queries: Sequence[EvidenceQuery]) -> list[list[str]]:
        return [[] for _ in queries]


@EVIDENCE.register("given")
class GivenEvidence:
    """The sample's own materials, unchanged (at most ``max_passages``)."""

    def __init__(self, max_passages: int = 16) -> None:
        self.max_passages = max_passages

    def get_batch(self, queries: Sequence[EvidenceQuery]) -> list[list[str]]:
        return [list(q.materials[: self.max_passages]) for q in queries]


def _terms(text: str) -> list[str]:
    return [t for t in _TOKEN.findall(text.lower()) if t not in _STOP]


def chunk_sections(materials: Sequence[str], max_words: int = 64, title: str | None = None) -> list[str]:
    """Sentences appended until a section would exceed ``max_words`` words (RLFH), title-prefixed."""
    sections: list[str] = []
    for doc in materials:
        current: list[str] = []
        n_words = 0
        for span in split_sentences(doc):
            sent = span.slice(doc)
            words = len(sent.split())
            if current and n_words + words > max_words:
                sections.append(" ".join(current))
                current, n_words = [], 0
            current.append(sent)
            n_words += words
        if current:
            sections.append(" ".join(current))
    return [f"{title}: {s}" if title else s for s in sections]


def bm25_scores(query_terms: Sequence[str], docs: Sequence[Sequence[str]], k1: float = 1.5, b: float = 0.75,
                epsilon: float = 0.25) -> list[float]:
    """BM25Okapi scores with rank_bm25's IDF (negative IDFs floored at ``epsilon * mean idf``)."""
    n = len(docs)
    if n == 0:
        return []
    avgdl = sum(len(d) for d in docs) / n or 1.0
    df = Counter(t for d in docs for t in set(d))
    idf = {t: math.log(n - f + 0.5) - math.log(f + 0.5) for t, f in df.items()}
    floor = epsilon * (sum(idf.values()) / len(idf)) if idf else 0.0
    idf = {t: (v if v >= 0 else floor) for t, v in idf.items()}
    scores = []
    for d in docs:
        tf = Counter(d)
        s = 0.0
        for q in query_terms:
            f = tf.get(q, 0)
            if f:
                s += idf.get(q, 0.0) * f * (k1 + 1) / (f + k1 * (1 - b + b * len(d) / avgdl))
        scores.append(s)
    return scores


@EVIDENCE.register("bm25_sections")
class BM25Sections:
    """RLFH retrieval over the sample's materials: sections of <= ``max_words_per_sec`` words, top ``top_k``.

    Each sentence of the claim is a query; per-query scores are summed over queries (as RLFH does)
    and sections with total score <= 0 are dropped.
    """

    def __init__(self, max_words_per_sec: int = 64, top_k: int = 3) -> None:
        self.max_words, self.top_k = max_words_per_sec, top_k

    def get_batch(self, queries: Sequence[EvidenceQuery]) -> list[list[str]]:
        out = []
        for q in queries:
            sections = chunk_sections(q.materials, self.max_words, q.topic)
            docs = [_terms(s) for s in sections]
            sub_queries = [sp.slice(q.claim.text) for sp in split_sentences(q.claim.text)] or [q.prompt]
            total = [0.0] * len(sections)
            for sq in sub_queries:
                for i, s in enumerate(bm25_scores(_terms(sq), docs)):
                    total[i] += s
            ranked = sorted((i for i in range(len(sections)) if total[i] > 0), key=lambda i: -total[i])
            out.append([sections[i] for i in ranked[: self.top_k]])
        return out


def _kb_query(q: EvidenceQuery, title_scoped: bool) -> tuple[str, str | None]:
    """The search text (topic + claim) and the title to scope to (the topic, when scoping)."""
    title = q.topic if (title_scoped and q.topic) else None
    return (f"{q.topic} {q.claim.text}" if q.topic else q.claim.text), title


@EVIDENCE.register("kb")
class KnowledgeStoreEvidence:
    """Top-``k`` passages from the embedded store; scoped to the sample's topic title when it has one.

    ``workers`` processes answer a large batch's BM25 queries in parallel (None or 0: every core;
    small batches stay in-process). ``max_df_frac``: see ``KnowledgeStore`` (1.0: exact BM25).
    """

    def __init__(self, store_path: str, k: int = 5, title_scoped: bool = True, dense: bool = False,
                 workers: int | None = None, max_df_frac: float = 0.3) -> None:
        from nemo_factuality.knowledge.store import KnowledgeStore

        self.store = KnowledgeStore(store_path, max_df_frac=max_df_frac)
        self.dense = None
        if dense:  # embedding search (GTR-style in FActScore/KnowRL) instead of BM25
            from nemo_factuality.knowledge.dense import DenseIndex

            self.dense = DenseIndex(store_path, store=self.store)
        self.k, self.title_scoped, self.workers = k, title_scoped, workers

    def health(self) -> dict[str, str | None]:
        return {"knowledge_store": self.store.health()}

    def get_batch(self, queries: Sequence[EvidenceQuery]) -> list[list[str]]:
        texts, titles = zip(*(_kb_query(q, self.title_scoped) for q in queries)) if queries else ((), ())
        if self.dense is not None:
            hits = self.dense.search_batch(texts, k=self.k, titles=titles)
        else:
            hits = self.store.search_batch(texts, k=self.k, titles=titles, workers=self.workers)
        return [[p.text for p in ps] for ps in hits]


def reciprocal_rank_fusion(rankings: Sequence[Sequence[int]], k: int = 60) -> list[int]:
    """Ids ordered by RRF score ``sum over rankings of 1 / (k + rank)`` (rank from 1; Cormack et al. 2009).

    Ties keep first-seen order, so the result is deterministic. Cost is linear in the total length.
    """
    score: dict[int, float] = {}
    for ranking in rankings:
        for rank, pid in enumerate(ranking, start=1):
            score[pid] = score.get(pid, 0.0) + 1.0 / (k + rank)
    return sorted(score, key=lambda pid: -score[pid])


@EVIDENCE.register("kb_hybrid")
class HybridEvidence:
    """BM25 and dense retrieval from the store, fused by reciprocal rank; top ``k`` passages.

    Each retriever returns its top ``fetch_k``; ``rrf_k`` is RRF's damping constant (60 in the
    paper). Title scoping applies to both retrievers, as in ``kb``. Needs ``kb build --dense``.
    """

    def __init__(self, store_path: str, k: int = 5, title_scoped: bool = True, fetch_k: int = 50, rrf_k: int = 60,
                 workers: int | None = None, encoder_path: str | None = None, max_df_frac: float = 0.3) -> None:
        from nemo_factuality.knowledge.dense import DenseIndex
        from nemo_factuality.knowledge.store import KnowledgeStore

        if fetch_k < k or rrf_k < 0:
            raise FactualityInputError(f"kb_hybrid needs fetch_k >= k and rrf_k >= 0 (got fetch_k={fetch_k}, k={k}, "
                                       f"rrf_k={rrf_k})")
        self.store = KnowledgeStore(store_path, max_df_frac=max_df_frac)
        self.dense = DenseIndex(store_path, store=self.store, encoder_path=encoder_path)
        self.k, self.title_scoped, self.fetch_k, self.rrf_k, self.workers = k, title_scoped, fetch_k, rrf_k, workers

    def health(self) -> dict[str, str | None]:
        return {"knowledge_store": self.store.health()}

    def get_batch(self, queries: Sequence[EvidenceQuery]) -> list[list[str]]:
        if not queries:
            return []
        texts, titles = zip(*(_kb_query(q, self.title_scoped) for q in queries))
        sparse = self.store.search_batch(texts, k=self.fetch_k, titles=titles, workers=self.workers)
        dense = self.dense.search_batch(texts, k=self.fetch_k, titles=titles)
        out = []
        for bm25_hits, dense_hits in zip(sparse, dense):
            text_of = {p.id: p.text for p in bm25_hits + dense_hits}
            fused = reciprocal_rank_fusion([[p.id for p in bm25_hits], [p.id for p in dense_hits]], self.rrf_k)
            out.append([text_of[pid] for pid in fused[: self.k]])
        return out
