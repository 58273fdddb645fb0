"""The factuality reward server on PyTriton: NeMo-Aligner's ``reward_model`` plus a richer ``factuality_reward``.

* ``reward_model`` — exactly NeMo-Aligner 0.7.0's protocol: optional inputs ``sentences`` (bytes),
  ``tokens`` (int64) and ``sequence_lengths`` (int64), output ``rewards`` float32 ``[B, 1]``. Token
  ids are the *policy's*; they are decoded with the policy tokenizer and split at the assistant marker.
  NaN (abstain, or a sample whose judge failed) becomes ``nan_reward`` because Aligner cannot take
  NaN; every such sample is counted (``factuality_nan_rewards_total{model, reason}``) and logged.
* ``factuality_reward`` — the same inputs (+ ``prompt_lengths``) or ``prompts``/``completions`` bytes
  and per-sample JSON ``columns``; outputs ``rewards [B, 1]`` (NaN kept), ``token_rewards [B, S]``
  float32 and ``token_signs [B, S]`` int8 aligned to the tokens received (prompt positions 0), and
  ``details [B, 1]`` JSON bytes (components, ``error`` per failed sample, response token count).

Failures: a sample whose extraction/verification/judge failed is NaN with ``details.error``; with
``fail_fast: true`` any such sample fails the whole batch instead (the caller gets the reasons).

Health: ``GET /health/live`` and ``/health/ready`` on ``health_port`` (ready = every downstream judge
and knowledge store answers; the JSON names what is down). Prometheus metrics on ``metrics_port``.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import math
import os
import re
import socket
import sysconfig
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from nemo_factuality.config import ConfigError
from nemo_factuality.serving.answered import AnsweredRows
from nemo_factuality.serving.config import ServeConfig
from nemo_factuality.serving.decode import PayloadDecoder, decode_text, pad_rows
from nemo_factuality.types import FactualityInputError, RewardBatch

log = logging.getLogger(__name__)
_BATCH_IDS = itertools.count(1)


PORT_KEYS = ("http_port", "grpc_port", "triton_metrics_port", "health_port", "metrics_port")


def check_ports(cfg: ServeConfig, keys: tuple[str, ...] = PORT_KEYS) -> None:
    """Every ``*_port`` key of ``keys`` distinct, a TCP port, and free on ``host``; else a ``ConfigError`` naming the key.

    Checked before Triton starts: a taken HTTP port otherwise surfaces as Triton's misleading
    ``[403] ... triton-access-token`` error, and a taken health port only after Triton is up."""
    seen: dict[int, str] = {}
    for key in keys:
        port = getattr(cfg, key)
        if not 0 < port < 65536:
            raise ConfigError(f"{key}={port} is not a TCP port (1-65535)")
        if port in seen:
            raise ConfigError(f"{key}={port} is also {seen[port]}: give each of {', '.join(keys)} its own port")
        seen[port] = key
        _check_bindable(cfg.host, port, key)


def _check_bindable(host: str, port: int, key: str) -> None:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise ConfigError(f"host={host!r} does not resolve ({err.strerror}); use an address of this machine, "
                          "e.g. 0.0.0.0 or 127.0.0.1") from err
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as err:
            held = " (another process is listening on it)" if err.errno == errno.EADDRINUSE else ""
            raise ConfigError(f"{key}={port}: cannot listen on {host}:{port}: {err.strerror}{held}; stop it or choose "
                              f"another {key}") from err


def ensure_python_backend_env() -> None:
    """Triton's Python-backend stub links libpython; point it at this interpreter's (pyenv/conda installs)."""
    libdir = sysconfig.get_config_var("LIBDIR")
    current = os.environ.get("LD_LIBRARY_PATH", "")
    if libdir and libdir not in current.split(":"):
        os.environ["LD_LIBRARY_PATH"] = f"{libdir}:{current}" if current else libdir


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("factuality_requests", "inference batches served", ["model"], registry=self.registry)
        self.samples = Counter("factuality_samples", "samples scored", ["model"], registry=self.registry)
        self.errors = Counter("factuality_request_errors", "batches that failed", ["model"], registry=self.registry)
        self.latency = Histogram("factuality_batch_latency_seconds", "reward latency per batch", ["model"],
                                 registry=self.registry)
        self.nan_rewards = Counter("factuality_nan_rewards", "samples sent as nan_reward / NaN: reason = error | abstain",
                                   ["model", "reason"], registry=self.registry)
        self.sample_errors = Counter("factuality_sample_errors", "samples whose fact-check or judge failed",
                                     ["model"], registry=self.registry)
        self.repeated_samples = Counter("factuality_repeated_samples", "samples of a resent request answered from the "
                                        "first one's result (request ids), not judged again", ["model"], registry=self.registry)


class _RewardStatsCollector:
    """Exports the reward's own counters (claims verified, judge errors, cache hits) at scrape time."""

    def __init__(self, reward: Any) -> None:
        self.reward = reward

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        fn = getattr(self.reward, "stats", None)
        stats = fn() if callable(fn) else {}
        for name, value in sorted(stats.items()):
            yield GaugeMetricFamily(f"factuality_reward_{name}", f"reward component counter {name}", value=float(value))


class FactualityRewardServer:
    """Owns the Triton server, the health endpoint and the metrics endpoint for one reward."""

    def __init__(self, cfg: ServeConfig, reward: Any, *, tokenizer: Any = None) -> None:
        """``tokenizer``: the policy's, already loaded (``serve`` loads it once, for the reward too); else it is
        loaded from ``cfg.policy_tokenizer`` (a local directory: ``local_models``)."""
        self.cfg, self.reward = cfg, reward
        if tokenizer is None and cfg.policy_tokenizer:
            from nemo_factuality.local_models import load_tokenizer

            tokenizer = load_tokenizer(cfg.policy_tokenizer, "policy_tokenizer")
        self.tokenizer = tokenizer
        self.decoder = PayloadDecoder(self.tokenizer, cfg.response_marker) if self.tokenizer is not None else None
        self.metrics = _Metrics()
        self._triton = None
        self._http: list[ThreadingHTTPServer] = []
        self._workspace: tempfile.TemporaryDirectory | None = None
        self._lock = threading.Lock()  # the reward's judges keep their own concurrency; batches run one at a time
        self.answered = AnsweredRows(cfg.answered_rows_kept)  # a resent request is answered, not judged again

    # ------------------------------------------------------------------ text extraction
    def _texts(self, inputs: dict[str, np.ndarray]) -> tuple[list[str], list[str], list[tuple[int, ...]] | None, list[int]]:
        """(prompts, completions, response token ids or None, response offsets in the token rows)."""
        if "tokens" in inputs:
            if "sequence_lengths" not in inputs:
                raise FactualityInputError("'tokens' given without 'sequence_lengths' ([B, 1] int64)")
            if inputs["tokens"].dtype != np.int64:
                raise FactualityInputError(f"'tokens' must be int64, got {inputs['tokens'].dtype}")
            if self.decoder is None:
                raise FactualityInputError("this server has no policy tokenizer; set policy_tokenizer in the serve config")
            samples = self.decoder.decode(inputs["tokens"], inputs["sequence_lengths"], inputs.get("prompt_lengths"))
            return [s.prompt for s in samples], [s.response for s in samples], [s.response_ids for s in samples], \
                [s.prompt_len for s in samples]
        if "completions" in inputs:
            completions = decode_text(inputs["completions"], "completions")
            prompts = decode_text(inputs["prompts"], "prompts") if "prompts" in inputs else [""] * len(completions)
            return prompts, completions, None, [0] * len(completions)
        if "sentences" in inputs:
            texts = decode_text(inputs["sentences"], "sentences")
            marker = self.decoder.marker if self.decoder is not None else self.cfg.response_marker
            if not marker:
                raise FactualityInputError("'sentences' input needs response_marker (or policy_tokenizer) to split the prompt")
            splits = [t.rsplit(marker, 1) if marker in t else ["", t] for t in texts]
            return [s[0] for s in splits], [s[1] for s in splits], None, [0] * len(texts)
        raise FactualityInputError("send 'tokens' + 'sequence_lengths', 'sentences', or 'completions' (+ 'prompts')")

    def _columns(self, inputs: dict[str, np.ndarray], n: int, ids: list[tuple[int, ...]] | None) -> dict[str, list]:
        columns: dict[str, list] = {}
        if "columns" in inputs:
            rows = [json.loads(t) if t else {} for t in decode_text(inputs["columns"], "columns")]
            for k in sorted({k for r in rows for k in r}):
                columns[k] = [r.get(k) for r in rows]
        if ids is not None:
            columns["completion_ids"] = [list(x) for x in ids]
            eos = getattr(self.tokenizer, "eos_token_id", None)
            columns.setdefault("is_end", [bool(x) and x[-1] == eos for x in ids])
        return columns

    def _score(self, model: str, inputs: dict[str, np.ndarray]) -> tuple[RewardBatch, list[tuple[int, ...]] | None, list[int], int]:
        batch_id = next(_BATCH_IDS)
        start = time.perf_counter()
        try:
            prompts, completions, ids, offsets = self._texts(inputs)
            columns = self._columns(inputs, len(completions), ids)
            request_ids = decode_text(inputs["request_ids"], "request_ids") if "request_ids" in inputs else None

            def score_rows(rows: list[int] | None) -> RewardBatch:
                if rows is None:
                    return self.reward(prompts, completions, **columns)
                return self.reward([prompts[i] for i in rows], [completions[i] for i in rows],
                                   **{k: [v[i] for i in rows] for k, v in columns.items()})

            with self._lock:
                result, repeated = self.answered.score(request_ids, score_rows)
        except Exception:
            self.metrics.errors.labels(model).inc()
            log.exception("batch %d (%s) failed", batch_id, model)
            raise
        elapsed = time.perf_counter() - start
        errors = sample_errors(result)
        if errors:
            self.metrics.sample_errors.labels(model).inc(len(errors))
            log.warning("batch %d (%s): %d of %d samples failed (first: sample %d: %s)", batch_id, model, len(errors),
                        len(result), *next(iter(errors.items())))
            if self.cfg.fail_fast:
                self.metrics.errors.labels(model).inc()
                raise RuntimeError(f"batch {batch_id}: fail_fast is set and {len(errors)} of {len(result)} samples failed: "
                                   + "; ".join(f"sample {i}: {e}" for i, e in list(errors.items())[:5]))
        if repeated:
            self.metrics.repeated_samples.labels(model).inc(repeated)
            log.warning("batch %d (%s): %d of %d samples were answered before (a resent request): not judged again",
                        batch_id, model, repeated, len(completions))
        self.metrics.requests.labels(model).inc()
        self.metrics.samples.labels(model).inc(len(completions) - repeated)
        self.metrics.latency.labels(model).observe(elapsed)
        log.info("batch %d (%s): %d samples in %.3f s", batch_id, model, len(completions), elapsed)
        token_level = result.token_rewards if result.token_rewards is not None else result.token_signs
        width = inputs["tokens"].shape[1] if "tokens" in inputs else max([len(t) for t in (token_level or [])] or [0])
        return result, ids, offsets, width

    # ------------------------------------------------------------------ infer functions
    def infer_reward_model(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        model = self.cfg.reward_model_name
        result, _, _, _ = self._score(model, inputs)
        nan = np.isnan(result.scores)
        if nan.any():
            n_err = len(sample_errors(result))
            self.metrics.nan_rewards.labels(model, "error").inc(n_err)
            self.metrics.nan_rewards.labels(model, "abstain").inc(int(nan.sum()) - n_err)
            log.warning("%s: %d of %d samples NaN (%d failed, %d abstained) sent as nan_reward=%g", model, int(nan.sum()),
                        len(result), n_err, int(nan.sum()) - n_err, self.cfg.nan_reward)
        scores = np.where(nan, self.cfg.nan_reward, result.scores)
        return {"rewards": scores.astype(np.float32).reshape(-1, 1)}

    def infer_rich(self, **inputs: np.ndarray) -> dict[str, np.ndarray]:
        result, ids, offsets, width = self._score(self.cfg.rich_model_name, inputs)
        n = len(result)
        width = max(width, 1)
        token_rewards = pad_rows(result.token_rewards or [np.zeros(0)] * n, offsets, width, np.float32)
        token_signs = pad_rows(result.token_signs or [np.zeros(0)] * n, offsets, width, np.int8)
        details = []
        # text requests: the response's token count is that of the token-level output (FSPO has only signs)
        token_level = result.token_rewards if result.token_rewards is not None else result.token_signs
        for i in range(n):
            d = {"components": {k: (None if math.isnan(v) else v) for k, v in result.sample_dict(i).items() if k != "score"},
                 "n_response_tokens": len(ids[i]) if ids is not None else len((token_level or [[]] * n)[i]),
                 "response_offset": offsets[i],
                 # which token-level outputs the reward has (the other is sent as zeros the client must not use)
                 "token_outputs": [k for k in ("token_rewards", "token_signs") if getattr(result, k) is not None]}
            if result.details is not None:
                d["details"] = result.details[i]
                if result.details[i].get("error"):
                    d["error"] = result.details[i]["error"]
            if result.sentence_labels is not None:
                d["sentence_labels"] = result.sentence_labels[i]
            if result.sentence_spans is not None:  # FactAlign's fKTO needs the sentences its labels are about
                d["sentence_spans"] = [[span.start, span.end] for span in result.sentence_spans[i]]
            details.append(json.dumps(d, default=str).encode("utf-8"))
        return {"rewards": result.scores.astype(np.float32).reshape(-1, 1), "token_rewards": token_rewards,
                "token_signs": token_signs, "details": np.array(details, dtype=object).reshape(-1, 1)}

    # ------------------------------------------------------------------ lifecycle
    def health(self) -> dict[str, str | None]:
        return reward_health(self.reward)

    def start(self) -> FactualityRewardServer:
        from pytriton.decorators import batch
        from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
        from pytriton.triton import Triton, TritonConfig

        ensure_python_backend_env()
        cfg = self.cfg
        check_ports(cfg)
        workspace = cfg.workspace
        if workspace is None:
            self._workspace = tempfile.TemporaryDirectory(prefix="nemo_factuality_triton_")
            workspace = os.path.join(self._workspace.name, "ws")
        triton_cfg = TritonConfig(http_address=cfg.host, http_port=cfg.http_port, grpc_address=cfg.host, grpc_port=cfg.grpc_port,
                                  metrics_port=cfg.triton_metrics_port, allow_metrics=True, allow_gpu_metrics=False)
        model_cfg = ModelConfig(batching=True, max_batch_size=cfg.max_batch_size,
                                batcher=DynamicBatcher(max_queue_delay_microseconds=cfg.max_queue_delay_us,
                                                       preferred_batch_size=list(cfg.preferred_batch_sizes)))
        common = [Tensor(name="sentences", shape=(-1,), dtype=bytes, optional=True),
                  Tensor(name="request_ids", shape=(-1,), dtype=bytes, optional=True),
                  Tensor(name="tokens", shape=(-1,), dtype=np.int64, optional=True),
                  Tensor(name="sequence_lengths", shape=(-1,), dtype=np.int64, optional=True)]
        self._triton = Triton(config=triton_cfg, workspace=workspace)
        route_triton_output_to_logging(self._triton)
        self._triton.bind(model_name=cfg.reward_model_name, infer_func=batch(self.infer_reward_model), inputs=common,
                          outputs=[Tensor(name="rewards", shape=(1,), dtype=np.float32)], config=model_cfg)
        rich_inputs = common + [Tensor(name=n, shape=(-1,), dtype=d, optional=True) for n, d in
                                (("prompt_lengths", np.int64), ("prompts", bytes), ("completions", bytes), ("columns", bytes))]
        rich_outputs = [Tensor(name="rewards", shape=(1,), dtype=np.float32), Tensor(name="token_rewards", shape=(-1,), dtype=np.float32),
                        Tensor(name="token_signs", shape=(-1,), dtype=np.int8), Tensor(name="details", shape=(1,), dtype=bytes)]
        self._triton.bind(model_name=cfg.rich_model_name, infer_func=batch(self.infer_rich), inputs=rich_inputs,
                          outputs=rich_outputs, config=model_cfg)
        self._triton.run()
        try:
            self._start_http()
        except OSError as err:  # taken since check_ports: stop Triton rather than leave it serving half a server
            self.stop()
            raise ConfigError(f"health_port={cfg.health_port} / metrics_port={cfg.metrics_port}: cannot listen on "
                              f"{cfg.host}: {err.strerror}; choose other ports") from err
        log.info("serving %s and %s on %s:%d (health :%d, metrics :%d)%s", cfg.reward_model_name, cfg.rich_model_name,
                 cfg.host, cfg.http_port, cfg.health_port, cfg.metrics_port, _exposure(cfg.host))
        return self

    def _start_http(self) -> None:
        from prometheus_client import start_http_server

        self.metrics.registry.register(_RewardStatsCollector(self.reward))
        server, thread = start_http_server(self.cfg.metrics_port, addr=self.cfg.host, registry=self.metrics.registry)
        self._http.append(server)
        health = ThreadingHTTPServer((self.cfg.host, self.cfg.health_port), _health_handler(self))
        threading.Thread(target=health.serve_forever, name="factuality-health", daemon=True).start()
        self._http.append(health)

    def stop(self) -> None:
        for server in self._http:
            server.shutdown()
            server.server_close()
        self._http.clear()
        if self._triton is not None:
            self._triton.stop()
            self._triton = None
        if self._workspace is not None:
            self._workspace.cleanup()
            self._workspace = None

    def __enter__(self) -> FactualityRewardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _exposure(host: str) -> str:
    """What ``host`` exposes, said once at start-up: the default, as NeMo-Aligner's reward server, is every interface."""
    if host in ("0.0.0.0", "::", ""):
        return (f"; host={host or '0.0.0.0'} listens on every network interface, so trainers on other nodes reach it "
                "(NeMo-Aligner's default); set host=127.0.0.1 to serve this machine only")
    return ""


TRITON_LOG = logging.getLogger("nemo_factuality.serving.tritonserver")
_TRITON_LEVELS = {"E": logging.ERROR, "W": logging.WARNING, "I": logging.DEBUG}
_TRITON_PREFIX = re.compile(r"^([EWI])\d{4} ")  # glog: E0101 12:00:00.000000 123 file.cc:45] message
#: tritonserver start-up lines logged as errors or warnings that are neither on a machine without a GPU, each at DEBUG:
_TRITON_BENIGN = (
    # every start on a machine without a CUDA driver: the server then runs its CPU (python-backend) models, as here
    '"CudaDriverHelper has not been initialized."',
    # PyTriton hands tritonserver each model's config in memory, not as a config.pbtxt file whose time it could read
    '"Failed to set config modification time: model_config_content_name_ is empty"',
    # (a warning) no CUDA driver, so no pinned host memory pool: only GPU models' transfers would use it
    '"Unable to allocate pinned system memory, pinned memory pool will not be available: CUDA driver version is '
    'insufficient for CUDA runtime version"',
)


def route_triton_output_to_logging(triton: Any) -> None:
    """Send tritonserver's output to ``logging`` (logger ``nemo_factuality.serving.tritonserver``) instead of stdout.

    PyTriton (0.5–0.7) prints every line tritonserver writes to stdout from a background thread (its
    ``TritonServer(verbose=True)``, which ``Triton`` does not expose), so a server started in-process (the lab, the
    tests) printed Triton's log between pytest's dots or the lab's progress, e.g. the Python backend's traceback
    of a failed batch (``proxy/model.py(501): execute``), a character at a time. Here each whole line is logged,
    errors and warnings as such and the rest at DEBUG, but for the start-up lines of ``_TRITON_BENIGN`` that every
    successful CPU start prints as errors; a continuation line (a traceback's) keeps the level of the line it
    continues. PyTriton still keeps
    the lines for its own crash report. A PyTriton without these hooks is left as it is."""
    initialize = getattr(triton, "_initialize_server", None)
    if initialize is None:
        return
    level, pending = [logging.DEBUG], [""]  # PyTriton hands over the output unbuffered: a character at a time

    def log_line(text: str) -> None:
        *lines, pending[0] = (pending[0] + text).split("\n")
        for line in lines:
            match = _TRITON_PREFIX.match(line)
            if match:
                level[0] = _TRITON_LEVELS[match.group(1)]
                if level[0] >= logging.WARNING and line.rstrip().endswith(_TRITON_BENIGN):
                    level[0] = logging.DEBUG
            if line.strip():
                TRITON_LOG.log(level[0], "%s", line.rstrip())

    def initialize_quietly() -> None:
        initialize()
        server = getattr(triton, "_triton_server", None)
        record = getattr(server, "_record_logs", None)
        if server is None or record is None or not hasattr(server, "_verbose"):
            return
        server._verbose = False  # no print() to stdout

        def record_and_log(line: bytes | str) -> None:
            record(line)
            log_line(line.decode("utf-8", errors="replace") if isinstance(line, bytes) else line)

        server._record_logs = record_and_log

    triton._initialize_server = initialize_quietly


def reward_health(reward: Any) -> dict[str, str | None]:
    """``{part: None (up) | why it is down}`` from the reward's ``health()``; a probe that raises says so."""
    fn = getattr(reward, "health", None)
    try:
        return fn() if callable(fn) else {}
    except Exception as err:  # a health probe must answer, and say why it could not check
        return {"reward": f"health check raised {type(err).__name__}: {err}"}


def sample_errors(result: RewardBatch) -> dict[int, str]:
    """``{sample index: reason}`` for the samples whose reward failed (``details[i]["error"]``)."""
    return {i: str(d["error"]) for i, d in enumerate(result.details or []) if d and d.get("error")}


def _health_handler(server: FactualityRewardServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("health: " + fmt, *args)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.rstrip("/") == "/health/live":
                status, body = 200, {"live": True}
            elif self.path.rstrip("/") == "/health/ready":
                checks = server.health()
                down = {k: v for k, v in checks.items() if v}
                ready = server._triton is not None and not down
                status, body = (200 if ready else 503), {"ready": ready, "checks": checks, "down": down}
            else:
                status, body = 404, {"error": "use /health/live or /health/ready"}
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
