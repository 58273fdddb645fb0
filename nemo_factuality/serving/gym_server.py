"""``nemo-factuality serve protocol=nemo_gym``: a method reward as a NeMo-Gym resources server, on FastAPI + uvicorn.

The routes NeMo-Gym's agents and rollout collection call (``gym_protocol`` holds their logic, the same code the
NeMo-Gym adapter runs): ``POST /seed_session``, ``POST /verify``, ``POST /aggregate_metrics``; beside them ``GET /``
(NeMo-Gym's liveness check), ``/health/live``, ``/health/ready`` (503 naming what is down) and ``/metrics``
(Prometheus), all on ``http_port``. Errors are JSON ``{"detail": "<one line>"}`` with the status ``gym_protocol``
gives (422 bad input, 503 no reward for this response or busy, 500 the reward raised).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from nemo_factuality.config import ConfigError
from nemo_factuality.serving.config import ServeConfig
from nemo_factuality.serving.gym_protocol import GymRequestError, GymRewardService

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0


def _one_line(exc: Any) -> str:
    """FastAPI's validation errors as one line: where and what, the first error (a body that is not JSON, a field)."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    if not errors:
        return str(exc)
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not JSON ({(first.get('ctx') or {}).get('error', 'invalid')})"
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg', 'invalid')}{more}"


def error_response(status: int, detail: str) -> Any:
    from fastapi.responses import JSONResponse

    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def add_health_routes(app: Any, service: GymRewardService, registry: Any = None) -> None:
    """``/health/live``, ``/health/ready`` and (with a Prometheus ``registry``) ``/metrics`` on ``app``."""
    from fastapi.responses import JSONResponse, Response

    @app.get("/health/live")
    def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/health/ready")
    def ready() -> Any:  # a sync route: the reward's probes block, FastAPI runs them on its thread pool
        checks = service.health()
        down = {k: v for k, v in checks.items() if v}
        return JSONResponse({"ready": not down, "checks": checks, "down": down}, status_code=503 if down else 200)

    if registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        def metrics() -> Any:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def build_app(service: GymRewardService, registry: Any = None) -> Any:
    """The FastAPI app serving ``service``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError

    app = FastAPI(title="nemo-factuality NeMo-Gym resources server")

    @app.exception_handler(GymRequestError)
    async def gym_error(_: Request, exc: GymRequestError) -> Any:
        if exc.status >= 500:
            log.warning("%s: %s", exc.status, exc)
        return error_response(exc.status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Any:
        return error_response(422, f"{request.url.path}: {_one_line(exc)}")

    @app.get("/")
    def liveness() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/seed_session")
    async def seed_session(body: dict[str, Any]) -> dict[str, Any]:
        return service.seed_session(body)

    @app.post("/verify")
    async def verify(body: dict[str, Any]) -> dict[str, Any]:
        return await service.verify(body)

    @app.post("/aggregate_metrics")
    def aggregate_metrics(body: dict[str, Any]) -> dict[str, Any]:
        return service.aggregate_metrics(body)

    add_health_routes(app, service, registry)
    return app


class GymRewardServer:
    """Owns the uvicorn server (on a thread of its own) and the batcher for one reward; ``start()`` / ``stop()``."""

    def __init__(self, cfg: ServeConfig, reward: Any) -> None:
        from nemo_factuality.serving.server import _Metrics, _RewardStatsCollector

        self.cfg, self.reward = cfg, reward
        self.metrics = _Metrics()
        self.metrics.registry.register(_RewardStatsCollector(reward))
        self.service: GymRewardService | None = None
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{'127.0.0.1' if self.cfg.host in ('0.0.0.0', '::', '') else self.cfg.host}:{self.cfg.http_port}"

    def start(self) -> GymRewardServer:
        import uvicorn

        from nemo_factuality.serving.server import _exposure, check_ports

        check_ports(self.cfg, ("http_port",))
        self.service = GymRewardService(self.reward, self.cfg, self.metrics)
        config = uvicorn.Config(build_app(self.service, self.metrics.registry), host=self.cfg.host,
                                port=self.cfg.http_port, log_level="warning", access_log=False, timeout_keep_alive=30,
                                timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)
        self._uvicorn.install_signal_handlers = lambda: None  # the caller owns SIGINT/SIGTERM (serve's stop event)
        self._thread = threading.Thread(target=self._uvicorn.run, name="factuality-gym-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"http_port={self.cfg.http_port}: the NeMo-Gym server did not start listening on "
                                  f"{self.cfg.host}:{self.cfg.http_port}; choose another http_port")
            time.sleep(0.02)
        log.info("serving the reward as a NeMo-Gym resources server (/seed_session, /verify, /aggregate_metrics) on "
                 "%s:%d%s", self.cfg.host, self.cfg.http_port, _exposure(self.cfg.host))
        return self

    def stop(self) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.service is not None:
            self.service.close()
        self._uvicorn = self._thread = self.service = None

    def __enter__(self) -> GymRewardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
