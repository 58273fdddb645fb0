"""``nemo-factuality lab [--quick] [--compare] [--seed N] --out DIR``: the factuality lab, end to end on CPU.

Builds a synthetic world and its knowledge store, pretrains a tiny policy that hallucinates on rare
people, runs factuality RL against the lab reward served on PyTriton, and evaluates before and after
with ``nemo-factuality eval``. Everything lands in DIR (see ``nemo_factuality.lab.run``).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nemo-factuality lab", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="run folder (created; must be empty or absent)")
    p.add_argument("--quick", action="store_true", help="small world and short training (CI; under 3 minutes)")
    p.add_argument("--compare", action="store_true", help="also train precision-only and slot-dense reward variants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reward", choices=("pytriton", "inprocess"), default="pytriton",
                   help="serve the lab reward on PyTriton in this process (default) or call it in-process")
    p.add_argument("--trainable", choices=("calibration", "all"), default="calibration",
                   help="what RL may change: the final norm + the abstention row (default), or every weight")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="GRPO stage overrides on conf/lab/grpo.yaml, e.g. model.optim.lr=5e-5 trainer.max_steps=40")
    return p


def check_direction(report: dict) -> list[str]:
    """What ``--quick`` asserts: held-out FActScore rose, claims did not collapse. Returns the failures."""
    s = report["summary"]
    problems = []
    if not s["heldout_factscore_gain_points"] > 0:
        problems.append(f"held-out FActScore did not rise ({s['heldout_factscore_gain_points']:+.1f} points)")
    if not s["heldout_claims_change"] > -0.5:
        problems.append(f"held-out claims per response fell by {-100 * s['heldout_claims_change']:.0f}% (> 50%)")
    return problems


def main(argv: Sequence[str]) -> int:
    import torch

    from nemo_factuality.lab.run import LabConfig, quick_config, run_lab

    args = _parser().parse_args(list(argv))
    if args.out.exists() and any(args.out.iterdir()):
        raise FactualityInputError(f"--out {args.out} is not empty; pick a new folder (a run folder holds one run)")
    if args.threads is not None:
        if args.threads < 1:
            raise FactualityInputError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    cfg = quick_config(args.seed) if args.quick else LabConfig(seed=args.seed)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise FactualityInputError(f"overrides must look like key=value, got {bad}")
    cfg = replace(cfg, compare=args.compare, reward_transport=args.reward, trainable=args.trainable, grpo_overrides=tuple(args.overrides),
                  world=replace(cfg.world, seed=args.seed))
    report = run_lab(cfg, args.out)
    print((args.out / "report.md").read_text(encoding="utf-8"))
    print(json.dumps(report["summary"], indent=2))
    if args.quick:
        problems = check_direction(report)
        if problems:
            log.error("lab --quick: %s", "; ".join(problems))
            return 1
    return 0
