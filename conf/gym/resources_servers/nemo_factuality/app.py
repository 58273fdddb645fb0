"""NeMo-Gym's entry for nemo-factuality's rewards: a ``SimpleResourcesServer`` NeMo-Gym's runner starts.

NeMo-Gym (0.4.0) starts a resources server as ``python app.py`` in ``resources_servers/<name>/`` (looked up under the
working directory first), in the venv of that folder with its config block from ``configs/nemo_factuality.yaml``. This
class only adapts NeMo-Gym's request and reply models: the reward logic — request → prompt, completion and columns,
batching, the reply's ``reward`` and ``factuality``, failures as HTTP errors, the factuality metrics — is
``nemo_factuality.serving.gym_protocol``, the same code ``nemo-factuality serve protocol=nemo_gym`` runs.

Config (beside NeMo-Gym's ``entrypoint``/``domain``/``host``/``port``):

* ``serve_config``: ``conf/serve/<name>.yaml`` of nemo-factuality (``klcf``, ``rlfh``, ``fspo``, ``knowrl``,
  ``factalign``) or a YAML path — the same file ``nemo-factuality serve --config-name`` reads;
* ``overrides``: its ``key=value`` overrides (``reward.judge.base_url=http://judge:8000/v1``, ``nan_reward=-1``,
  ``gym.max_batch_size=32``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.config_types import AggregateMetrics, AggregateMetricsRequest
from pydantic import ConfigDict, Field, PrivateAttr

from nemo_factuality.config import load_config
from nemo_factuality.serving.cli import build_served_reward
from nemo_factuality.serving.config import ServeConfig
from nemo_factuality.serving.gym_protocol import KEY_METRICS, GymRequestError, GymRewardService, factuality_metrics
from nemo_factuality.serving.gym_server import add_health_routes


class FactualityResourcesServerConfig(BaseResourcesServerConfig):
    serve_config: str = Field(description="nemo-factuality's conf/serve/<name>.yaml (klcf, fspo, ...) or a YAML path")
    overrides: list[str] = Field(default_factory=list, description="its key=value overrides (ServeConfig keys)")


class FactualityVerifyRequest(BaseVerifyRequest):
    model_config = ConfigDict(extra="allow")  # the dataset row's own fields: the reward's columns


class FactualityVerifyResponse(BaseVerifyResponse):
    model_config = ConfigDict(extra="allow")

    factuality: dict[str, Any]  # why: score, components, claims, verdicts (FSPO: sentence_signs)


class FactualityResourcesServer(SimpleResourcesServer):
    config: FactualityResourcesServerConfig
    _service: Any = PrivateAttr(default=None)

    def model_post_init(self, context: Any) -> None:
        cfg = load_config(ServeConfig, self.config.serve_config, list(self.config.overrides), group="serve")
        reward, _ = build_served_reward(cfg)
        self._service = GymRewardService(reward, cfg)
        return super().model_post_init(context)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        add_health_routes(app, self._service)
        return app

    async def verify(self, body: FactualityVerifyRequest) -> FactualityVerifyResponse:
        try:
            reply = await self._service.verify(body.model_dump(mode="json"))
        except GymRequestError as err:  # NeMo-Gym's way: a verify that is not 2xx fails its rollout, never a reward
            raise HTTPException(status_code=err.status, detail=str(err)) from None
        return FactualityVerifyResponse.model_validate(reply)

    async def aggregate_metrics(self, body: AggregateMetricsRequest) -> AggregateMetrics:
        try:  # NeMo-Gym's baseline statistics with the factuality metrics merged in (compute_metrics)
            return await super().aggregate_metrics(body)
        except GymRequestError as err:
            raise HTTPException(status_code=err.status, detail=str(err)) from None

    def compute_metrics(self, tasks: list[list[dict[str, Any]]]) -> dict[str, Any]:
        return factuality_metrics([reply for task in tasks for reply in task])["agent_metrics"]

    def get_key_metrics(self, agent_metrics: dict[str, Any]) -> dict[str, Any]:
        return {k: agent_metrics.get(k) for k in KEY_METRICS}


if __name__ == "__main__":
    FactualityResourcesServer.run_webserver()
