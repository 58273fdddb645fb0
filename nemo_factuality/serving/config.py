"""Typed schema for ``nemo-factuality serve`` (every default lives here; YAML in ``conf/serve/`` overrides it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_factuality.config import ConfigError

DEFAULT_REWARD: dict[str, Any] = {"name": "factalign", "pipeline": {}}
PROTOCOLS = ("triton", "nemo_gym")


@dataclass
class GymServeConfig:
    """The NeMo-Gym resources server (``protocol=nemo_gym``): how its ``/verify`` requests are batched."""

    # Concurrent /verify requests scored in one reward call (NeMo-Gym sends one request per rollout).
    max_batch_size: int = 64
    # How long the first request of a batch waits for more before the batch is scored.
    max_queue_delay_ms: float = 5.0
    # Requests waiting or being scored at once; one more is refused with 503 (bounded memory), not queued.
    max_pending: int = 1024


@dataclass
class ServeConfig:
    # What the server speaks: triton (PyTriton: NeMo-Aligner's reward_model + factuality_reward) or nemo_gym
    # (a NeMo-Gym resources server: /seed_session, /verify, /aggregate_metrics on http_port).
    protocol: str = "triton"
    # The method reward, built by name from nemo_factuality.registry.REWARDS: {name: klcf, ...kwargs}; None:
    # DEFAULT_REWARD. (A dict default would be merged key by key under a config file's block, giving e.g. FSPO a
    # `pipeline` key it does not take.)
    reward: dict[str, Any] | None = None
    # Local path of the POLICY's tokenizer: NeMo-Aligner sends policy token ids, never text.
    policy_tokenizer: str | None = None
    # Text that starts the response in a rendered chat (None: derived from the tokenizer's chat template).
    response_marker: str | None = None
    host: str = "0.0.0.0"  # interface the servers bind (0.0.0.0: every interface)
    http_port: int = 5555  # NeMo-Aligner's remote_rm.reward_model.port default
    grpc_port: int = 5565  # Triton's gRPC port
    triton_metrics_port: int = 5575  # Triton's own metrics port
    health_port: int = 5580  # GET /health/live, /health/ready (JSON with reasons)
    metrics_port: int = 5581  # Prometheus text format
    reward_model_name: str = "reward_model"  # NeMo-Aligner's remote_rm.reward_model.name
    rich_model_name: str = "factuality_reward"  # the Triton model with token rewards, signs and details
    # Largest request (samples) Triton accepts. NeMo-Aligner's RemoteGPTRMClient sends a whole rollout batch in
    # one request and Aligner's own reward server accepts any size (9999999), so this default does too; lower it
    # to cap memory per batch (a larger request is then refused with Triton's batch-size error).
    max_batch_size: int = 9_999_999
    preferred_batch_sizes: list[int] = field(default_factory=lambda: [8, 16, 32])  # Triton dynamic batching's preferred sizes
    max_queue_delay_us: int = 2000  # how long Triton waits to fill a preferred batch
    # NeMo-Aligner cannot take NaN rewards: abstentions are sent as this value on the reward_model wire.
    nan_reward: float = 0.0
    # A sample whose judge/fact-check failed is NaN (+ details.error) by default; fail_fast fails the whole
    # batch instead, so the caller (trainer) stops rather than trains around the failures.
    fail_fast: bool = False
    # Rows a resent request may be answered from (by the client's request ids) instead of judged again; 0 = off.
    answered_rows_kept: int = 65536
    health_check_interval_s: float = 5.0  # how often readiness re-checks the judges and the store
    workspace: str | None = None  # PyTriton workspace (default: a temporary directory)
    gym: GymServeConfig = field(default_factory=GymServeConfig)

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol={self.protocol!r}: choose one of {', '.join(PROTOCOLS)}")
        gym = self.gym
        if isinstance(gym, GymServeConfig) and (gym.max_batch_size < 1 or gym.max_pending < gym.max_batch_size
                                                or gym.max_queue_delay_ms < 0):
            raise ConfigError(f"gym.max_batch_size={gym.max_batch_size}, gym.max_pending={gym.max_pending}, "
                              f"gym.max_queue_delay_ms={gym.max_queue_delay_ms}: need 1 <= max_batch_size <= max_pending "
                              "and a delay >= 0")
