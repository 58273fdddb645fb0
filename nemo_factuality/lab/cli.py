"""``nemo-factuality lab``: the factuality lab, end to end on CPU.

Builds a world and its knowledge store (invented people, or the real countries), takes a policy that
hallucinates on rare entities (a tiny one pretrained here, or a real pretrained model), trains it with each
selected method through the method's own stage and reward (served on PyTriton), and evaluates every policy
with ``nemo-factuality eval``. Everything lands in DIR (see ``nemo_factuality.lab.run``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from nemo_factuality import exit_codes
from nemo_factuality.cli import ArgumentParser, positive_int
from nemo_factuality.lab.methods import GROUPS, METHODS, REAL_TRAINABLE, TRAINABLE
from nemo_factuality.lab.worlds import WORLDS
from nemo_factuality.types import FactualityInputError

DEFAULT_REAL_POLICY = "smollm2-135m-instruct"

log = logging.getLogger(__name__)


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="nemo-factuality lab", description=__doc__.split("\n\n")[1].replace("\n", " "),
                       epilog="key=value overrides change the selected methods' stage configs (conf/lab/{grpo,ppo,kto}.yaml), "
                              "e.g. trainer.max_steps=40; reward.<option>=value changes their rewards; prefix "
                              "'<method>:' to change one method only, e.g. rlfh:critic.optim.lr=3e-4.")
    p.add_argument("--out", type=Path, required=True, help="run folder (created; must be empty or absent)")
    p.add_argument("--methods", default="all",
                   help=f"comma-separated: {', '.join(METHODS)}; 'fspo' = both FSPO settings; "
                        f"'all' = {', '.join(GROUPS['all'])}")
    p.add_argument("--seeds", default="0", help="comma-separated seeds; several give mean ± sd in the report")
    p.add_argument("--world", choices=WORLDS, default="synthetic",
                   help="synthetic: 1000 invented people, a tiny policy pretrained here; countries: countryinfo's "
                        "countries, a real pretrained --policy")
    p.add_argument("--policy", default=None,
                   help="countries: a model-zoo name (default smollm2-135m-instruct, converted once) or an HF folder; "
                        "synthetic: the tiny policy only")
    p.add_argument("--quick", action="store_true", help="small world and short training (CI)")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="worker processes for the seeds' and methods' tasks (default: one per usable CPU, at most one per task)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch threads per process (more than 1 only pays on an otherwise idle machine)")
    p.add_argument("--reward", choices=("pytriton", "inprocess"), default="pytriton",
                   help="serve each method's reward on PyTriton in its process, or call it in-process")
    p.add_argument("--trainable", choices=(*TRAINABLE, *REAL_TRAINABLE), default=None,
                   help="what training may change. Synthetic (default calibration): the final norm's gains (a "
                        "temperature) and the abstention token's output row; that row alone (abstention); or every "
                        "weight (all: then lower the lr, e.g. model.optim.lr=1e-4). Countries (default top_layers): the "
                        "top 4 decoder layers and the final norm; or LoRA adapters on every projection (lora)")
    p.add_argument("overrides", nargs="*", metavar="[method:]key=value", help="stage config or reward overrides (see below)")
    return p


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise FactualityInputError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise FactualityInputError(f"--seeds must name distinct seeds, got {text!r}")
    return seeds


def check_direction(report: dict) -> list[str]:
    """What ``--quick`` asserts, per method: held-out FActScore at T=1 rose (the base is kept when nothing
    beat it on validation, so a flat method fails here) and claims did not collapse. Returns the failures."""
    problems = []
    for name, m in report["methods"].items():
        gain = m["gain"]["t1"]["mean"]
        before, after = m["heldout"]["before"]["claims_per_response"], m["heldout"]["after"]["claims_per_response"]
        if not gain > 0:
            problems.append(f"{name}: held-out FActScore did not rise ({gain:+.1f} points)")
        if not after > 0.5 * before:
            problems.append(f"{name}: held-out claims per response fell by more than half ({before:.2f} -> {after:.2f})")
    return problems


def _world_config(args: Any) -> Any:
    """The run's ``LabConfig`` for ``--world`` / ``--policy`` / ``--trainable`` / ``--quick``, the pairs checked."""
    from nemo_factuality.lab.run import LabConfig, countries_config, quick_config

    if args.world == "synthetic":
        if args.policy not in (None, "tiny"):
            raise FactualityInputError(f"--policy {args.policy!r}: the synthetic world trains its own tiny policy (its "
                                       "tokenizer is its bios' words); a real policy needs --world countries")
        if args.trainable in REAL_TRAINABLE:
            raise FactualityInputError(f"--trainable {args.trainable} is for a real policy (--world countries); the tiny "
                                       f"policy takes {', '.join(TRAINABLE)}")
        return quick_config() if args.quick else LabConfig()
    if args.trainable in TRAINABLE:
        raise FactualityInputError(f"--trainable {args.trainable} is the tiny policy's; a real policy takes "
                                   f"{', '.join(REAL_TRAINABLE)}")
    from nemo_factuality.lab.real_policy import resolve_policy

    policy = args.policy or DEFAULT_REAL_POLICY
    resolve_policy(policy)  # before any work: a wrong name fails now (a known name is converted once, here)
    return countries_config(policy, quick=args.quick)


def main(argv: Sequence[str]) -> int:
    from nemo_factuality.lab.methods import check_overrides, select_methods
    from nemo_factuality.lab.run import run_lab

    p = build_parser()
    args = p.parse_intermixed_args(list(argv))
    bad = [o for o in args.overrides if "=" not in o or o.startswith("=")]
    if bad:
        p.error(f"unrecognised arguments {bad}: overrides look like [method:]key=value")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise FactualityInputError(f"--out {args.out} is not an empty folder; pick a new one (a run folder holds one run)")
    methods, seeds = select_methods(args.methods), _seeds(args.seeds)
    cfg = _world_config(args)
    jobs = args.jobs or max(1, min(_usable_cpus(), len(seeds) * len(methods)))
    cfg = replace(cfg, methods=methods, seeds=seeds, jobs=jobs, threads=args.threads, reward_transport=args.reward,
                  trainable=args.trainable or cfg.trainable, overrides=tuple(args.overrides))
    check_overrides(cfg.overrides, cfg.methods, cfg.presets)  # every key and value, before any work
    report = run_lab(cfg, args.out)
    print((args.out / "report.md").read_text(encoding="utf-8"))
    print(f"wrote {args.out / 'report.md'}, {args.out / 'report.json'} and the plots in {args.out / 'plots'}/ "
          f"(per-method runs, metrics and eval reports under {args.out}/)")
    if args.quick and cfg.world_name == "synthetic":  # one step per method on a real model shows no direction
        problems = check_direction(report)
        if problems:
            log.error("lab --quick: %s", "; ".join(problems))
            return exit_codes.FAILURE
    return exit_codes.OK
