"""OpenAI-compatible judge client (vLLM's server in production): concurrent, bounded, retrying, cached.

``complete_batch`` never raises per item: every request gets a ``JudgeReply`` whose ``error``
says what failed, at which URL and model, and which config key to change. Callers (parsers,
verifiers) turn failures into ``Label.UNPARSEABLE`` — never into a silent default label.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nemo_factuality.interfaces import ChatRequest, JudgeReply
from nemo_factuality.judge.cache import JudgeCache, request_key

log = logging.getLogger(__name__)
_REQUEST_IDS = itertools.count(1)


class _Retryable(Exception):
    """A failure worth retrying (5xx, 429, timeout, connection loss, malformed body)."""


class _Fatal(Exception):
    """A failure retrying cannot fix (4xx other than 429)."""


@dataclass
class JudgeStats:
    requests: int = 0
    errors: int = 0
    retries: int = 0
    cache_hits: int = 0
    latency_s_total: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


class OpenAIJudgeClient:
    """Chat completions against ``{base_url}/chat/completions``.

    Args:
        base_url: endpoint root ending in ``/v1`` (e.g. ``http://judge-node:8000/v1`` for ``vllm serve``).
        model: model name the server serves.
        api_key: bearer token, if the server wants one.
        concurrency: requests in flight at once (match vLLM's ``--max-num-seqs`` headroom).
        timeout_s: per-attempt timeout.
        max_retries: retries after the first attempt, with exponential backoff and jitter.
        backoff_s: first backoff delay; doubles each retry.
        cache: a ``JudgeCache`` or a path for one; ``None`` disables caching.
    """

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, concurrency: int = 32,
                 timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5,
                 cache: JudgeCache | str | Path | None = None) -> None:
        if concurrency < 1:
            raise ValueError(f"judge.concurrency must be >= 1, got {concurrency}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.concurrency, self.timeout_s, self.max_retries, self.backoff_s = concurrency, timeout_s, max_retries, backoff_s
        self.cache = JudgeCache(cache) if isinstance(cache, (str, Path)) else cache
        self.stats = JudgeStats()
        self._stats_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._tls: Any = None  # httpx's default TLS context, built once: loading the CA bundle costs ~50 ms a batch

    def __repr__(self) -> str:
        return f"OpenAIJudgeClient({self.base_url!r}, model={self.model!r}, concurrency={self.concurrency})"

    # ------------------------------------------------------------------ sync API
    def complete_batch(self, requests: Sequence[ChatRequest]) -> list[JudgeReply]:
        """Run all requests with at most ``concurrency`` in flight; replies in request order."""
        if not requests:
            return []
        future = asyncio.run_coroutine_threadsafe(self.acomplete_batch(requests), self._ensure_loop())
        return future.result()

    def health(self) -> dict[str, str | None]:
        """``{"judge:<model>": None}`` when ``GET /models`` answers, else the reason."""
        key = f"judge:{self.model}"
        try:
            resp = httpx.get(f"{self.base_url}/models", timeout=min(self.timeout_s, 5.0), headers=self._headers())
            if resp.status_code != 200:
                return {key: f"{self.base_url}/models answered HTTP {resp.status_code}"}
            return {key: None}
        except httpx.HTTPError as err:
            return {key: f"judge endpoint {self.base_url} unreachable: {type(err).__name__}: {err}"}

    def close(self) -> None:
        with self._loop_lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                if self._loop_thread is not None:
                    self._loop_thread.join(timeout=5)
                self._loop.close()
            self._loop = self._loop_thread = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        # A private loop thread makes the sync API work even when the caller already runs an event loop.
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="judge-client-loop", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    # ------------------------------------------------------------------ async API
    async def acomplete_batch(self, requests: Sequence[ChatRequest]) -> list[JudgeReply]:
        semaphore = asyncio.Semaphore(self.concurrency)
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        with self._loop_lock:
            if self._tls is None:
                self._tls = httpx.create_ssl_context()
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=self._headers(), verify=self._tls) as http:
            return list(await asyncio.gather(*(self._one(http, semaphore, r) for r in requests)))

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    async def _one(self, http: httpx.AsyncClient, semaphore: asyncio.Semaphore, request: ChatRequest) -> JudgeReply:
        rid = next(_REQUEST_IDS)
        model = request.model or self.model
        key = request_key(model, request) if self.cache is not None else ""
        if self.cache is not None and (hit := self.cache.get(key)) is not None:
            self._count(requests=1, cache_hits=1)
            return JudgeReply(hit[0], cached=True, finish_reason=hit[1], logprobs=tuple(hit[2]) if hit[2] else None)
        payload = {"model": model, "messages": [dict(m) for m in request.messages], "temperature": request.temperature,
                   "top_p": request.top_p, "max_tokens": request.max_tokens, **dict(request.extra)}
        start, last_error = time.perf_counter(), ""
        async with semaphore:
            for attempt in range(1, self.max_retries + 2):
                try:
                    text, finish, logprobs = await self._post(http, payload)
                    latency = time.perf_counter() - start
                    self._count(requests=1, latency_s_total=latency, retries=attempt - 1)
                    if self.cache is not None:
                        self.cache.put(key, text, finish, list(logprobs) if logprobs else None)
                    return JudgeReply(text, latency_s=latency, attempts=attempt, finish_reason=finish, logprobs=logprobs)
                except _Fatal as err:
                    last_error = str(err)
                    break
                except _Retryable as err:
                    last_error = str(err)
                    log.debug("judge request %d attempt %d failed: %s", rid, attempt, err)
                    if attempt <= self.max_retries:
                        await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
        self._count(requests=1, errors=1, retries=attempt - 1, latency_s_total=time.perf_counter() - start)
        message = (f"judge request {rid} to {self.base_url}/chat/completions (model {model!r}) failed after "
                   f"{attempt} attempt(s): {last_error}. Check the server, or raise judge.timeout_s / judge.max_retries")
        log.warning(message)
        return JudgeReply(None, error=message, latency_s=time.perf_counter() - start, attempts=attempt)

    async def _post(self, http: httpx.AsyncClient, payload: dict[str, Any]) -> tuple[str, str | None, tuple | None]:
        try:
            resp = await http.post(f"{self.base_url}/chat/completions", json=payload)
        except httpx.TimeoutException:
            raise _Retryable(f"timed out after {self.timeout_s:g} s") from None
        except httpx.TransportError as err:
            raise _Retryable(f"connection error: {type(err).__name__}: {err}") from None
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:200]!r}")
        if resp.status_code != 200:
            raise _Fatal(f"HTTP {resp.status_code} (not retried): {resp.text[:200]!r}")
        try:
            body = resp.json()
            choice = body["choices"][0]
            text = choice["message"]["content"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise _Retryable(f"malformed response body: {resp.text[:200]!r}") from None
        if not isinstance(text, str):
            raise _Retryable(f"response content is {type(text).__name__}, not text")
        raw_logprobs = choice.get("logprobs") if isinstance(choice, dict) else None
        logprobs = raw_logprobs.get("content") if isinstance(raw_logprobs, dict) else raw_logprobs
        # Whatever shape came back is handed on as is; the p(true) parser turns a malformed one into an
        # unparseable verdict rather than this client raising for the whole batch.
        if logprobs is not None and not isinstance(logprobs, (list, tuple)):
            logprobs = (logprobs,)
        return text, choice.get("finish_reason"), tuple(logprobs) if logprobs else None
