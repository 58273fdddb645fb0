"""``nemo-factuality serve --config-name <method> [key=value ...]``: serve a method reward on PyTriton, or with
``protocol=nemo_gym`` as a NeMo-Gym resources server (``serving.gym_server``)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from nemo_factuality.cli import ArgumentParser, split_overrides
from nemo_factuality.config import load_config, to_yaml

if TYPE_CHECKING:
    from nemo_factuality.serving.config import ServeConfig

log = logging.getLogger(__name__)


def main(argv: Sequence[str]) -> int:
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.gym_server import GymRewardServer
    from nemo_factuality.serving.server import PORT_KEYS, FactualityRewardServer, check_ports

    parser = build_parser()
    args = parser.parse_intermixed_args(list(argv))
    overrides = split_overrides(args.overrides, parser.prog)
    if args.fail_fast:
        overrides = [*overrides, "fail_fast=true"]
    cfg = load_config(ServeConfig, args.config_name, overrides, group="serve")
    gym = cfg.protocol == "nemo_gym"
    check_ports(cfg, ("http_port",) if gym else PORT_KEYS)  # before the reward loads its models and stores
    reward, tokenizer = build_served_reward(cfg)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = GymRewardServer(cfg, reward).start() if gym else FactualityRewardServer(cfg, reward, tokenizer=tokenizer).start()
    log.info("serve config:\n%s", to_yaml(cfg))  # once serving: a start-up refusal (a port taken since) is the only output
    try:
        stop.wait()
    finally:
        server.stop()
    return 0


def build_served_reward(cfg: ServeConfig) -> tuple[Any, Any]:
    """(the reward of ``cfg.reward``, the policy tokenizer or None): what every server of ``serve`` scores with (the
    PyTriton one, the NeMo-Gym one, and the adapter NeMo-Gym's runner starts)."""
    from nemo_factuality.local_models import load_tokenizer
    from nemo_factuality.registry import build_reward
    from nemo_factuality.serving.config import DEFAULT_REWARD

    # a local directory, never a Hub id (local_models: one line, exit 2)
    tokenizer = load_tokenizer(cfg.policy_tokenizer, "policy_tokenizer") if cfg.policy_tokenizer else None
    # token-level rewards (RLFH, FSPO's signs) place their values with the policy's tokenizer, as in-process
    return build_reward(asdict(cfg)["reward"] or DEFAULT_REWARD, tokenizer), tokenizer


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="nemo-factuality serve",
                            description="Serve a method reward on PyTriton: reward_model (NeMo-Aligner 0.7.0's protocol) "
                                        "and factuality_reward (token rewards), with health and Prometheus endpoints; "
                                        "with protocol=nemo_gym, as a NeMo-Gym resources server (/seed_session, "
                                        "/verify, /aggregate_metrics) on http_port.",
                            usage="nemo-factuality serve --config-name NAME [key=value ...]",
                            epilog="key=value overrides set any ServeConfig field (nemo_factuality/serving/config.py), "
                                   "e.g. http_port=5555 max_batch_size=1024 nan_reward=0.0 policy_tokenizer=/models/policy "
                                   "reward.judge.base_url=http://judge:8000/v1 protocol=nemo_gym")
    parser.add_argument("--config-name", default=None,
                        help="conf/serve/<name>.yaml (klcf, rlfh, fspo, knowrl, factalign, demo) or a YAML path; "
                             "without it, ServeConfig's defaults")
    parser.add_argument("--fail-fast", action="store_true",
                        help="fail a whole batch when any sample's judge/fact-check fails (default: that sample is NaN "
                             "with details.error; reward_model sends nan_reward). Same as fail_fast=true")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser
