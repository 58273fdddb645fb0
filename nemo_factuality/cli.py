"""``nemo-factuality <command> [args...]``: a thin dispatcher to each command's own entry point.

Commands are imported lazily so ``nemo-factuality eval`` never imports PyTriton or Megatron.
Each target is ``module:function`` taking ``argv: list[str]`` and returning an exit code.
"""

from __future__ import annotations

import importlib
import logging
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("nemo_factuality.evaluation.cli:main", "score responses: FActScore, SAFE F1@K, VeriScore, HalluLens"),
    "kb": ("nemo_factuality.knowledge.cli:main", "build / query the embedded knowledge store"),
    "serve": ("nemo_factuality.serving.cli:main", "serve a method reward on PyTriton (NeMo-Aligner protocol)"),
    "convert": ("nemo_factuality.convert.cli:main", "HF <-> NeMo checkpoint conversion and verification"),
    "launch": ("nemo_factuality.launch.cli:main", "render / submit Slurm jobs from configs"),
    "train": ("nemo_factuality.trainers.cli:main", "run a training stage: grpo (KLCF/FSPO/KnowRL), ppo (RLFH), kto (FactAlign)"),
    "lab": ("nemo_factuality.lab.cli:main", "factuality lab: synthetic world, tiny policy, RL, before/after report"),
}


def _usage() -> str:
    lines = ["usage: nemo-factuality <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\nRun 'nemo-factuality <command> --help' for a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"nemo-factuality: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    target, _ = COMMANDS[command]
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    from nemo_factuality.types import FactualityInputError

    try:
        return int(func(rest) or 0)
    except FactualityInputError as err:  # bad input: say what is wrong, no traceback
        print(f"nemo-factuality {command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
