"""A persistent judge response cache in SQLite, keyed by (model, messages, sampling params).

Only successful replies are stored, so a transient judge failure is retried next time rather
than remembered. Safe across threads and processes (WAL journal, one connection per thread).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
from pathlib import Path

from nemo_factuality.interfaces import ChatRequest


def request_key(model: str, request: ChatRequest) -> str:
    payload = {
        "model": model,
        "messages": [dict(m) for m in request.messages],
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_tokens,
        "extra": dict(request.extra),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


class JudgeCache:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        conn = self._conn()
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, text TEXT NOT NULL, "
                     "finish_reason TEXT, logprobs TEXT)")
        conn.commit()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
            self._local.conn = conn
        return conn

    def get(self, key: str) -> tuple[str, str | None, list | None] | None:
        row = self._conn().execute("SELECT text, finish_reason, logprobs FROM replies WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        return row[0], row[1], (json.loads(row[2]) if row[2] else None)

    def put(self, key: str, text: str, finish_reason: str | None, logprobs: list | None = None) -> None:
        conn = self._conn()
        conn.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?)",
                     (key, text, finish_reason, json.dumps(logprobs) if logprobs is not None else None))
        conn.commit()

    def __len__(self) -> int:
        return self._conn().execute("SELECT count(*) FROM replies").fetchone()[0]
