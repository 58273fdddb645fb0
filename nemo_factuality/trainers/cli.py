"""``nemo-factuality train {grpo,ppo,kto} --config-name NAME [key=value ...]`` and the stages' ``python -m`` entry.

parse config → build actor (and critic), reward, data → run the stage's trainer → clean up.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

log = logging.getLogger(__name__)

STAGES = {
    "grpo": ("GRPOConfig", "KLCF, FSPO, KnowRL: group-relative policy optimisation"),
    "ppo": ("PPOConfig", "RLFH: PPO with a critic and token-level dense rewards"),
    "kto": ("KTOConfig", "FactAlign: iterated sample → label → KTO + fKTO"),
}


def _parser(stage: str | None) -> argparse.ArgumentParser:
    prog = f"nemo-factuality train {stage}" if stage else "nemo-factuality train"
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} --config-name NAME [key=value ...]",
                                description=STAGES[stage][1] if stage else "run a training stage",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config-name", default=None,
                   help="conf/train/<name>.yaml (klcf, fspo, knowrl → grpo; rlfh → ppo; factalign → kto) or a YAML path")
    return p


def run_stage(stage: str, argv: Sequence[str] | None) -> int:
    """Build everything from config and run ``stage``; returns the exit code."""
    from nemo_factuality.trainers import config as schemas
    from nemo_factuality.trainers.backends import BACKENDS
    from nemo_factuality.trainers.data import load_pairs, load_prompts
    from nemo_factuality.trainers.runtime import build_reward, seed_everything

    args, overrides = _parser(stage).parse_known_args(list(sys.argv[1:] if argv is None else argv))
    bad = [o for o in overrides if o.startswith("-")]
    if bad:
        from nemo_factuality.config import ConfigError

        raise ConfigError(f"unknown option(s) {bad}; configuration is set with key=value overrides")
    cfg = schemas.load_train_config(getattr(schemas, STAGES[stage][0]), args.config_name, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = Path(cfg.exp_manager.explicit_log_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    from nemo_factuality.config import to_yaml

    (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    train = load_prompts(cfg.data.train, cfg.data.format)
    val = load_prompts(cfg.data.validation, cfg.data.format) if cfg.data.validation else None
    seed_everything(cfg.trainer.seed)
    actor, critic = BACKENDS.get(cfg.trainer.backend)(cfg, critic=stage == "ppo")
    reward = build_reward(cfg, actor.tokenizer)
    try:
        if stage == "grpo":
            from nemo_factuality.trainers.grpo import GRPOTrainer

            GRPOTrainer(cfg, actor, reward, train, run_dir=run_dir, val_data=val).fit()
        elif stage == "ppo":
            from nemo_factuality.trainers.ppo import PPOTrainer

            PPOTrainer(cfg, actor, critic, reward, train, run_dir=run_dir, val_data=val).fit()
        else:
            from nemo_factuality.trainers.kto import KTOTrainer

            pairs = load_pairs(cfg.data.general_pairs) if cfg.data.general_pairs else []
            KTOTrainer(cfg, actor, reward, train, general_pairs=pairs, run_dir=run_dir).fit()
    finally:
        close = getattr(reward, "close", None)
        if callable(close):
            close()
    return 0


def main(argv: Sequence[str]) -> int:
    """``nemo-factuality train <stage> ...``."""
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        lines = ["usage: nemo-factuality train {grpo,ppo,kto} --config-name NAME [key=value ...]", "", "stages:"]
        lines += [f"  {k:<6} {v[1]}" for k, v in STAGES.items()]
        print("\n".join(lines), file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return run_stage(argv[0], argv[1:])


def exit_on_user_error(fn: Callable[[], int]) -> int:
    """For ``python -m nemo_factuality.trainers.<stage>``: user errors are one line on stderr and exit 2."""
    from nemo_factuality.config import ConfigError
    from nemo_factuality.registry import RegistryError
    from nemo_factuality.types import FactualityInputError

    try:
        return int(fn() or 0)
    except (FactualityInputError, ConfigError, RegistryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
