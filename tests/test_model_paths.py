"""Model paths are local directories, checked before any work (``nemo_factuality.local_models``): a path that does not
exist, a file, a directory without weights or tokenizer, or a truncated shard is one line and exit 2 — never a Hub
lookup (before: 49 s of Hub retries then a traceback, or "Repo id must be in the form…", and config.yaml written).

Each case runs the real ``nemo-factuality`` entry point in a subprocess, with the Hub *not* forced offline: a path
sent to the Hub would then show as a Hub error or a long wait.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_factuality.config import REPO_ROOT

ENV = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "NEMO_FACTUALITY_DEBUG")}
ENV.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nemo_factuality.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=240)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A working directory with a valid tiny policy and broken copies of it."""
    from nemo_factuality.testing.training import build_policy

    root = tmp_path_factory.mktemp("model_paths")
    good = build_policy(root / "policy")
    truncated = root / "truncated"
    shutil.copytree(good, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    no_tokenizer = root / "no_tokenizer"
    shutil.copytree(good, no_tokenizer)
    for f in ("tokenizer.json", "vocab.json", "tokenizer.model"):
        (no_tokenizer / f).unlink(missing_ok=True)
    (root / "weights.bin").write_bytes(os.urandom(4096))
    (root / "run").mkdir()
    return root


def _train(model_path: str, run: Path, *extra: str) -> list[str]:
    return ["train", "grpo", "--config-name", "tiny_cpu_standin", f"model.path={model_path}",
            f"exp_manager.explicit_log_dir={run}", "remote_rm.url=http://127.0.0.1:9", *extra]


CASES = {  # name: (model.path, a phrase the one line must contain)
    "relative_missing": ("outputs/nosuch_policy", "model.path=outputs/nosuch_policy: no such directory"),
    "absolute_missing": ("/models/nosuch", "model.path=/models/nosuch: no such directory"),
    "binary_file": ("weights.bin", "model.path=weights.bin is a file, not a model directory"),
    "truncated_shard": ("truncated", "model.safetensors is corrupted or truncated"),
    "no_tokenizer": ("no_tokenizer", "model.path=no_tokenizer has no tokenizer files"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_model_path_is_one_line_before_any_work(models, name):
    path, phrase = CASES[name]
    run = models / "run" / name
    start = time.monotonic()
    res = _cli(_train(path, run), models)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, f"rc={res.returncode}\n{res.stderr[-3000:]}"
    assert lines[0].startswith("nemo-factuality train: error: ") and phrase in lines[0], lines[0]
    assert "huggingface" not in res.stderr.lower() and "Repo id" not in res.stderr
    assert time.monotonic() - start < 60  # no Hub retries
    assert not run.exists()  # nothing written: no run directory, no config.yaml


def test_a_bad_critic_path_is_one_line_too(models):
    run = models / "run" / "critic"
    res = _cli(["train", "ppo", "--config-name", "tiny_cpu_rlfh", f"model.path={models / 'policy'}",
                "critic.path=outputs/nosuch_critic", "data.format=jsonl", "data.train=package:demo_prompts.jsonl",
                "reward=null", "remote_rm.url=http://127.0.0.1:9", f"exp_manager.explicit_log_dir={run}"], models)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "critic.path=outputs/nosuch_critic: no such directory" in lines[0] and not run.exists()


def test_the_trainer_says_what_it_waits_for(models):
    """The served reward's readiness check took ~8 s in silence; it now says what it waits for, then names it."""
    from nemo_factuality.testing.ports import free_ports

    (port,) = free_ports(1)  # nothing listens there
    res = _cli(_train(str(models / "policy"), models / "run" / "wait", f"remote_rm.url=http://127.0.0.1:{port}"), models)
    assert res.returncode == 2, res.stderr[-3000:]
    waiting = [line for line in res.stderr.splitlines() if "waiting for the reward server" in line]
    assert len(waiting) == 1 and f"http://127.0.0.1:{port}" in waiting[0] and "factuality_reward" in waiting[0], res.stderr
    errors = [line for line in res.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "the reward server is not ready" in errors[0]
    assert res.stderr.index(waiting[0]) < res.stderr.index(errors[0])  # said before the wait, not after


def test_the_tiny_policy_is_written_with_the_umask_mode(tmp_path):
    """``python -m nemo_factuality.testing.training`` wrote model.safetensors 0600 (safetensors' temporary file)."""
    out = tmp_path / "tiny_policy"
    res = subprocess.run([sys.executable, "-m", "nemo_factuality.testing.training", "--out", str(out)], env=ENV,
                         capture_output=True, text=True, timeout=240, preexec_fn=lambda: os.umask(0o022))
    assert res.returncode == 0, res.stderr[-3000:]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert modes["model.safetensors"] == "0o644" and set(modes.values()) == {"0o644"}, modes
