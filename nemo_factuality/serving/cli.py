"""``nemo-factuality serve --config-name <method> [key=value ...]``: serve a method reward on PyTriton."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from dataclasses import asdict
from typing import Sequence

from nemo_factuality.config import load_config, to_yaml

log = logging.getLogger(__name__)


def main(argv: Sequence[str]) -> int:
    from nemo_factuality.registry import REWARDS
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.server import FactualityRewardServer

    parser = argparse.ArgumentParser(prog="nemo-factuality serve", description=__doc__)
    parser.add_argument("--config-name", default=None, help="conf/serve/<name>.yaml (klcf, rlfh, fspo, knowrl, factalign, demo)")
    parser.add_argument("--fail-fast", action="store_true",
                        help="fail a whole batch when any sample's judge/fact-check fails (default: that sample is NaN "
                             "with details.error; reward_model sends nan_reward). Same as fail_fast=true")
    args, overrides = parser.parse_known_args(list(argv))
    if args.fail_fast:
        overrides = [*overrides, "fail_fast=true"]
    cfg = load_config(ServeConfig, args.config_name, overrides, group="serve")
    log.info("serve config:\n%s", to_yaml(cfg))
    reward = REWARDS.build(dict(asdict(cfg)["reward"]))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server = FactualityRewardServer(cfg, reward).start()
    try:
        stop.wait()
    finally:
        server.stop()
    return 0
