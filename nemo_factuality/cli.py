"""``nemo-factuality <command> [args...]``: a thin dispatcher to each command's own entry point.

Commands are imported lazily so ``nemo-factuality eval`` never imports PyTriton or Megatron.
Each target is ``module:function`` taking ``argv: list[str]`` and returning an exit code.

This module is the one error boundary of every command (``run_command``): a user error — bad
input, config or override, a path that does not exist, a bad flag — is printed as one line
``nemo-factuality <command>: error: <message>`` on stderr with exit code 2, never a traceback.
An error with an integer ``exit_code`` attribute (a run that had to stop without a result) is printed the
same way, ending ``(exit N)``, and exits with that code: ``trainers.runtime.TrainingStalledError`` (3: no valid
sample for ``trainer.max_invalid_steps`` steps) and ``ServerUnavailableError`` (75, sysexits' ``EX_TEMPFAIL``: a
server stayed away past its retry window; a training stage checkpointed first; "try again later", which the
Slurm launcher's requeue acts on). ``--debug`` (anywhere on the command line) or ``NEMO_FACTUALITY_DEBUG=1``
re-raises it with the traceback, for bug reports. Commands raise; they do not print errors themselves.
Exit codes: ``nemo_factuality.exit_codes`` (one table, also in the README).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from nemo_factuality import exit_codes

DEBUG_ENV = "NEMO_FACTUALITY_DEBUG"
COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("nemo_factuality.evaluation.cli:main", "score responses: FActScore, SAFE F1@K, VeriScore, HalluLens"),
    "kb": ("nemo_factuality.knowledge.cli:main", "build / query the embedded knowledge store"),
    "serve": ("nemo_factuality.serving.cli:main", "serve a method reward on PyTriton (NeMo-Aligner protocol)"),
    "convert": ("nemo_factuality.convert.cli:main", "HF <-> NeMo checkpoint conversion and verification"),
    "launch": ("nemo_factuality.launch.cli:main", "render / submit Slurm jobs from configs"),
    "train": ("nemo_factuality.trainers.cli:main", "run a training stage: grpo (KLCF/FSPO/KnowRL), ppo (RLFH), kto (FactAlign)"),
    "lab": ("nemo_factuality.lab.cli:main", "factuality lab: synthetic world, tiny policy, RL, before/after report"),
    "models": ("nemo_factuality.model_zoo:main", "real pretrained models, offline: get a known model's HF folder"),
}


class UsageError(ValueError):
    """A command line argparse rejects (unknown flag, missing or malformed value)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends ``(default: X)`` to an option's help unless there is no default to speak of (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        # identity, not ==: 0 and 0.0 equal False but are defaults worth showing
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or action.required \
                or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with every default shown in ``--help`` and errors raised (one line at the boundary), not printed;
    no abbreviations (``lab --seed 3`` silently meant ``--seeds 3``): a flag is its whole name or an error."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts such as ``--k`` (a bad value is one usage line, not a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def split_overrides(values: Sequence[str], prog: str) -> list[str]:
    """``key=value`` config overrides from positional words; anything else is a usage error."""
    bad = [v for v in values if "=" not in v or v.startswith("=")]
    if bad:
        raise UsageError(f"unrecognised arguments {bad}: config overrides look like key=value (see '{prog} --help')")
    return list(values)


def _user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the user asked for something wrong' (imported lazily: each is cheap)."""
    from nemo_factuality.config import ConfigError
    from nemo_factuality.registry import RegistryError
    from nemo_factuality.types import FactualityInputError

    types: list[type[BaseException]] = [UsageError, FactualityInputError, ConfigError, RegistryError,
                                        FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                                        PermissionError]
    launch = sys.modules.get("nemo_factuality.launch.render")  # only loaded when a launch command ran
    if launch is not None:
        types.append(launch.LaunchConfigError)
    return tuple(types)


def _one_line(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.strerror}: {err.filename}"
    text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    return " ".join(text.split()) or type(err).__name__


def debug_requested(argv: Sequence[str] = ()) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


# commands that decide themselves what a stop signal means: a training stage checkpoints on Slurm's SIGTERM and exits
# for the requeue; the reward server stops its PyTriton server and exits 0
OWN_STOP_SIGNALS = frozenset({"train", "serve"})


def run_command(func: Callable[[list[str]], int | None], argv: Sequence[str], name: str) -> int:
    """Run ``func(argv)`` behind the error boundary: user errors become one stderr line and exit code 2; SIGTERM and
    SIGINT one line saying the command stops, then what it started is stopped on the way out and it exits 128 + the
    signal (``stopping.stop_on_signals``; the commands of ``OWN_STOP_SIGNALS`` handle theirs)."""
    from contextlib import nullcontext

    from nemo_factuality.stopping import stop_on_signals

    debug = debug_requested(argv)
    argv = [a for a in argv if a != "--debug"]
    try:
        with nullcontext() if name in OWN_STOP_SIGNALS else stop_on_signals(name):
            return int(func(argv) or 0)
    except KeyboardInterrupt:
        print(f"nemo-factuality {name}: interrupted", file=sys.stderr)
        return exit_codes.INTERRUPTED
    except Exception as err:
        code = getattr(err, "exit_code", None)  # a run that stopped without a result: stalled, or a server gone
        if debug or not (isinstance(err, _user_error_types()) or isinstance(code, int)):
            raise
        if isinstance(code, int):  # says which exit, so a reader of the log knows it was a stop, not a crash
            print(f"nemo-factuality {name}: error: {_one_line(err)} (exit {code})", file=sys.stderr)
            return code
        print(f"nemo-factuality {name}: error: {_one_line(err)}", file=sys.stderr)
        return exit_codes.USER_ERROR


def _usage() -> str:
    lines = ["usage: nemo-factuality [--version] [--debug] <command> [args...] [key=value ...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "options:", "  --version  print the version and exit",
              f"  --debug    show the traceback of an error (also: {DEBUG_ENV}=1)",
              "", "Run 'nemo-factuality <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    words = [a for a in argv if a != "--debug"]
    if not words or words[0] in ("-h", "--help"):
        print(_usage())
        return exit_codes.OK
    if words[0] == "--version":
        from nemo_factuality import __version__

        print(f"nemo-factuality {__version__}")
        return exit_codes.OK
    command = words[0]
    if command not in COMMANDS:
        print(f"nemo-factuality: error: unknown command {command!r}; commands: {', '.join(COMMANDS)} "
              "(see 'nemo-factuality --help')", file=sys.stderr)
        return exit_codes.USER_ERROR
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module_name, func_name = COMMANDS[command][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    rest = argv[argv.index(command) + 1:]
    if "--debug" in argv[: argv.index(command)]:
        rest.append("--debug")
    return run_command(func, rest, command)


def run_as_module(*command: str) -> NoReturn:
    """``python -m <a command's module>`` (a training stage's, as the Slurm launcher runs it): ``nemo-factuality
    <command> <this process's arguments>`` through ``main``, so the same boundary, logging and exit codes. The
    dispatcher finds the command's module by name (``COMMANDS``), so a module calling this imports nothing that
    imports it back."""
    raise SystemExit(main([*command, *sys.argv[1:]]))


if __name__ == "__main__":  # `python -m nemo_factuality.cli`: use the package module, so its error types are the ones raised
    from nemo_factuality.cli import main as _main

    raise SystemExit(_main())
