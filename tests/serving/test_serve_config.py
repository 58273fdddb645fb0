"""``nemo-factuality serve`` builds each method's reward as the stages need it (no server started here)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from omegaconf import OmegaConf

from nemo_factuality.config import REPO_ROOT, conf_dir, load_config
from nemo_factuality.serving.config import ServeConfig

pytestmark = pytest.mark.waits  # mostly on serve's start-up and stop (tests/conftest.py gives it the waiting lane)

METHODS = ["klcf", "fspo", "knowrl", "rlfh", "factalign", "demo"]


@pytest.mark.parametrize("method", METHODS)
def test_a_serve_config_gets_exactly_its_files_reward_block(method):
    """No schema default is merged under the file's block (FSPO took no `pipeline` and failed to build)."""
    cfg = load_config(ServeConfig, method, [], group="serve")
    assert cfg.reward == OmegaConf.to_container(OmegaConf.load(conf_dir() / "serve" / f"{method}.yaml")["reward"])


def test_token_level_rewards_get_the_policy_tokenizer(tiny_tokenizer_dir):
    """Without it the served RLFH has no token rewards (FSPO no token signs): the stage would train on the scalar."""
    from nemo_factuality.registry import build_reward

    cfg = load_config(ServeConfig, "rlfh", [f"policy_tokenizer={tiny_tokenizer_dir}"], group="serve")
    assert build_reward(cfg.reward, cfg.policy_tokenizer).tokenizer is not None
    assert build_reward(cfg.reward).tokenizer is None  # nothing to hand over: the block decides


def test_the_client_returns_a_labellers_sentence_labels_and_spans():
    """FactAlign's sentence labels and their character spans come back over the wire (the KTO stage's fKTO)."""
    from nemo_factuality.serving.client import _to_batch
    from nemo_factuality.types import Span

    details = [{"components": {"label": 1.0}, "n_response_tokens": 0, "response_offset": 0, "token_outputs": [],
                "sentence_labels": [True, False], "sentence_spans": [[0, 5], [6, 12]]},
               {"components": {"label": 0.0}, "n_response_tokens": 0, "response_offset": 0, "token_outputs": [],
                "sentence_labels": [], "sentence_spans": []}]
    out = {"rewards": np.array([[0.9], [0.1]], dtype=np.float32), "token_rewards": np.zeros((2, 1), np.float32),
           "token_signs": np.zeros((2, 1), np.int8),
           "details": np.array([[json.dumps(d).encode()] for d in details], dtype=object)}
    batch = _to_batch(out)
    assert batch.sentence_labels == [[True, False], []]
    assert batch.sentence_spans == [[Span(0, 5), Span(6, 12)], []]
    assert batch.token_rewards is None and batch.token_signs is None  # the wire's zeros are padding
    del details[0]["sentence_spans"]  # a reward without sentence labels (every other method): none
    out["details"] = np.array([[json.dumps(d).encode()] for d in details], dtype=object)
    assert _to_batch(out).sentence_labels is None


def test_a_signs_only_reward_sends_its_signs_one_per_response_token(tiny_tokenizer):
    """FSPO has token signs and no token rewards: a text request still gets one sign per response token."""
    from nemo_factuality.serving.client import _to_batch
    from nemo_factuality.serving.server import FactualityRewardServer
    from nemo_factuality.types import RewardBatch

    def signs_only(prompts, completions, completion_ids, **_):
        return RewardBatch(np.ones(len(completions)), {"format": np.zeros(len(completions))},
                           token_signs=[np.full(len(ids), -1, np.int8) for ids in completion_ids])

    server = FactualityRewardServer(ServeConfig(), signs_only)
    ids = [[5, 6, 7], [8]]
    columns = np.array([[json.dumps({"completion_ids": x}).encode()] for x in ids], dtype=object)
    out = server.infer_rich(prompts=np.array([[b"p"], [b"q"]], dtype=object),
                            completions=np.array([[b"a b c"], [b"d"]], dtype=object), columns=columns)
    batch = _to_batch(out)
    assert [s.tolist() for s in batch.token_signs] == [[-1, -1, -1], [-1]] and batch.token_rewards is None


@pytest.fixture(scope="module")
def demo_workdir(tmp_path_factory):
    """A working directory where `serve --config-name demo` finds its store (outputs/demo_kb.sqlite)."""
    from nemo_factuality.knowledge.store import build_store

    root = tmp_path_factory.mktemp("serve_demo")
    data = REPO_ROOT / "nemo_factuality" / "data"
    build_store(data / "demo_passages.jsonl", root / "outputs" / "demo_kb.sqlite", facts_jsonl=data / "demo_facts.jsonl",
                progress=False)
    return root


@pytest.mark.parametrize("key", ["http_port", "health_port"])
def test_serve_on_a_taken_port_is_one_line_naming_the_key_and_port(demo_workdir, key):
    """Before: Triton's misleading `[403] ... triton-access-token` (http_port) or `OSError: Address already in use`
    (health_port, after Triton had started), exit 1. Now: checked before the reward or Triton starts."""
    import socket
    import subprocess
    import sys
    import time

    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.testing.servers import SERVE_PORT_KEYS

    ports = dict(zip(SERVE_PORT_KEYS, free_ports(len(SERVE_PORT_KEYS))))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTRITON_HOME=str(demo_workdir / "pytriton_home"))
    env.pop("NEMO_FACTUALITY_DEBUG", None)
    with socket.socket() as held:  # another process's server: bound and listening on loopback
        held.bind(("127.0.0.1", 0))
        held.listen()
        ports[key] = held.getsockname()[1]
        start = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "serve", "--config-name", "demo", "host=127.0.0.1",
                              *[f"{k}={v}" for k, v in ports.items()]], cwd=demo_workdir, env=env, capture_output=True,
                             text=True, timeout=180)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert lines[0].startswith(f"nemo-factuality serve: error: {key}={ports[key]}: cannot listen on 127.0.0.1:{ports[key]}: "
                               "Address already in use"), lines[0]
    assert time.monotonic() - start < 60  # no Triton was started to find out


def _serve(workdir, *overrides: str, timeout: float = 180):
    import subprocess
    import sys

    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.testing.servers import SERVE_PORT_KEYS

    ports = [f"{k}={v}" for k, v in zip(SERVE_PORT_KEYS, free_ports(len(SERVE_PORT_KEYS)))]
    env = {k: v for k, v in os.environ.items() if k not in ("NEMO_FACTUALITY_DEBUG", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTRITON_HOME=str(workdir / "pytriton_home"))
    return subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "serve", "--config-name", "demo", "host=127.0.0.1",
                           *ports, *overrides], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("overrides, phrase", [
    # before: 49 s of Hub retries, then a traceback (exit 1), after a 28-line config dump
    (["policy_tokenizer=outputs/nosuch"], "policy_tokenizer=outputs/nosuch: no such directory"),
    (["policy_tokenizer=outputs/demo_kb.sqlite"], "policy_tokenizer=outputs/demo_kb.sqlite is a file"),
    # an input the reward loads: the config dump came first
    (["reward.pipeline.verifier.store_path=outputs/nosuch.sqlite"], "knowledge store outputs/nosuch.sqlite does not exist"),
    # issue 54 item 2: before, a directory "does not exist"
    (["reward.pipeline.verifier.store_path=outputs"],
     "knowledge store outputs is a directory, not a file (it holds demo_kb.sqlite); pass the store's SQLite file"),
])
def test_a_serve_error_is_its_only_output(demo_workdir, overrides, phrase):
    res = _serve(demo_workdir, *overrides)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and res.stdout == "", res.stderr[-3000:]
    assert lines[0].startswith("nemo-factuality serve: error: ") and phrase in lines[0], lines[0]


def test_serve_says_it_listens_on_every_interface(demo_workdir, tiny_tokenizer_dir):
    """The default host, 0.0.0.0 (NeMo-Aligner's too: trainers on other nodes reach it), is said at start-up."""
    import signal
    import subprocess
    import sys
    import time

    from nemo_factuality.testing.ports import free_ports
    from nemo_factuality.testing.servers import SERVE_PORT_KEYS, wait_reward_ready

    ports = dict(zip(SERVE_PORT_KEYS, free_ports(len(SERVE_PORT_KEYS))))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTRITON_HOME=str(demo_workdir / "pytriton_home"))
    log = demo_workdir / "serve_default_host.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "nemo_factuality.cli", "serve", "--config-name", "demo",
                                 f"policy_tokenizer={tiny_tokenizer_dir}", *[f"{k}={v}" for k, v in ports.items()]],
                                cwd=demo_workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_reward_ready(proc, ports, log)
        deadline = time.monotonic() + 30
        while "serving reward_model" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    started = [line for line in log.read_text().splitlines() if "serving reward_model" in line]
    assert len(started) == 1, log.read_text()[-3000:]
    assert f"on 0.0.0.0:{ports['http_port']}" in started[0] and "every network interface" in started[0]
    assert "host=127.0.0.1" in started[0]  # how to keep it on this machine
