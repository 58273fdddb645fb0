"""NeMo-Aligner's own ``ReinforceTrainer.fit()`` (its ``MegatronGPTReinforceActorModel``, unmodified) on CPU/gloo
against the project's real reward server.

The test process writes a tiny Qwen2 policy that has learnt to answer two biography prompts with a few
sentences about the demo knowledge store's people, some true and some false (so sampled rollouts earn
different rewards), converts it with ``convert hf-to-nemo``, and starts ``nemo-factuality serve --config-name
demo`` (FactAlign on the demo store, no judge) on loopback in its own process group. The driver
(``aligner_fit_driver.py``, in the Aligner venv) runs 2 REINFORCE steps with validation after each and a
checkpoint at the end, and records every request Aligner's ``RemoteGPTRMClient`` sent and every metric Aligner
logged. The test then asks the server again for exactly those token rows and scores the decoded texts with the
demo reward in-process: the logged rewards are the server's, and the server's are FactAlign's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from nemo_factuality.testing import servers
from nemo_factuality.testing.aligner_env import aligner_venv, run_in_aligner_venv, skip_reason

REPO = Path(__file__).resolve().parents[2]
DRIVER = "tests/trainers/aligner_fit_driver.py"
PAD_TO = 96  # the driver's remote_rm.pad_to_length (SEQ_LENGTH): Aligner sends rows 0-padded to it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]

# FactAlign with k=10 on the demo store: f1@10 = 2R/(1+R), R = supported/10, when every claim is supported;
# a response whose only claim is wrong has precision 0, so 0.
ANSWERS = {
    "Ada Varga": {"Ada Varga was born in 1917.": 2 / 11, "Ada Varga was born in 1900.": 0.0,
                  "Ada Varga was born in 1917. Ada Varga grew up in Ostrava.": 1 / 3},
    "Boris Tanaka": {"Boris Tanaka was born in 1963.": 2 / 11, "Boris Tanaka was born in 1917.": 0.0},
}
KNOWN = {text: value for answers in ANSWERS.values() for text, value in answers.items()}


def _prompt(tokenizer, person: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {person}."}], tokenize=False,
                                         add_generation_prompt=True)


def build_answering_policy(out: Path):
    """A tiny Qwen2 + BPE tokenizer taught (≈2 s of next-token training) to answer with one of ANSWERS."""
    import torch

    from nemo_factuality.lab.policy import encode_docs, pretrain
    from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

    corpus = [*KNOWN, *(f"Tell me about {p}." for p in ANSWERS), "user assistant"]
    tokenizer = build_tiny_tokenizer(out, corpus=corpus)
    docs = [{"prompt": _prompt(tokenizer, person), "response": text} for person, answers in ANSWERS.items() for text in answers]
    ids, mask = encode_docs(tokenizer, docs)
    model = build_tiny_causal_lm("qwen2", vocab_size=len(tokenizer), seed=0)
    torch.manual_seed(0)
    pretrain(model, ids, mask, budget_s=60, max_steps=150, batch_size=8, lr=1e-2)
    model.save_pretrained(str(out))
    return tokenizer


@contextmanager
def reward_server(tokenizer_dir: Path, kb: Path, workdir: Path, stopped: dict):
    """``nemo-factuality serve --config-name demo`` on the demo store (``servers.reward_server``)."""
    with servers.reward_server("demo", [f"policy_tokenizer={tokenizer_dir}", f"reward.pipeline.verifier.store_path={kb}"],
                               workdir, stopped) as server:
        yield server


def _served_rewards(url: str, calls: list[dict]) -> list[list[float]]:
    """The server's ``reward_model`` answer for each recorded request, rebuilt as Aligner sends it."""
    from pytriton.client import ModelClient

    out = []
    with ModelClient(url, "reward_model", init_timeout_s=60, inference_timeout_s=60) as client:
        for call in calls:
            tokens = np.zeros((len(call["tokens"]), PAD_TO), dtype=np.int64)
            for i, row in enumerate(call["tokens"]):
                tokens[i, : len(row)] = row
            lengths = np.array([[len(row)] for row in call["tokens"]], dtype=np.int64)
            out.append(client.infer_batch(tokens=tokens, sequence_lengths=lengths)["rewards"][:, 0].tolist())
    return out


def _in_process_rewards(kb: Path, tokenizer, calls: list[dict]) -> tuple[list[list[str]], list[list[float]]]:
    """The demo serve config's reward, built as ``nemo-factuality serve`` builds it, on texts decoded at Aligner's
    own prompt lengths (not the server's marker search): (responses, rewards) per request."""
    from nemo_factuality.config import load_config
    from nemo_factuality.registry import REWARDS
    from nemo_factuality.serving.config import ServeConfig

    cfg = load_config(ServeConfig, "demo", [f"reward.pipeline.verifier.store_path={kb}"], group="serve")
    reward = REWARDS.build(dict(asdict(cfg)["reward"]))
    texts, scores = [], []
    for call in calls:
        prompts = [tokenizer.decode(row[:p], skip_special_tokens=False) for row, p in zip(call["tokens"], call["prompt_lengths"], strict=True)]
        responses = [tokenizer.decode(row[p:], skip_special_tokens=True) for row, p in zip(call["tokens"], call["prompt_lengths"], strict=True)]
        result = reward(prompts, responses)
        texts.append(responses)
        scores.append(np.where(np.isnan(result.scores), cfg.nan_reward, result.scores).tolist())
    return texts, scores


@pytest.fixture(scope="module")
def fit(tmp_path_factory):
    venv = aligner_venv()
    if venv is None:
        pytest.skip(skip_reason())
    root = tmp_path_factory.mktemp("aligner_fit")
    t0 = time.monotonic()
    tokenizer = build_answering_policy(root / "hf")
    kb = root / "demo_kb.sqlite"
    subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "kb", "build", "--demo", "--out", str(kb)],
                   env=servers.subprocess_env(), check=True, capture_output=True, timeout=120)
    for split, people in (("train", ["Ada Varga", "Boris Tanaka"] * 2), ("val", ["Ada Varga", "Boris Tanaka"])):
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"text": _prompt(tokenizer, p)}) + "\n" for p in people))
    stopped: dict = {}
    with reward_server(root / "hf", kb, root, stopped) as server:
        # the server starts (~15 s) while the policy is converted
        servers.convert_checkpoint("hf-to-nemo", "--hf", str(root / "hf"), "--out", str(root / "policy"), "--extracted")
        server["wait_ready"]()
        out = root / "out"
        run = run_in_aligner_venv(venv, [DRIVER, f"--nemo={root / 'policy'}", f"--train={root / 'train.jsonl'}",
                                         f"--val={root / 'val.jsonl'}", f"--port={server['ports']['http_port']}",
                                         f"--out={out}"], timeout=300)
        assert run.returncode == 0, run.stdout[-6000:]
        result = json.loads((out / "result.json").read_text())
        # run_bounded started the driver in its own session (pgid = its pid): anything still in that group
        # (e.g. the checkpoint writer's spawned helper) was left behind; note it, then stop it
        result["driver_left"] = servers.wait_group_empty(result["pid"], 5)
        if result["driver_left"]:
            os.killpg(result["pid"], signal.SIGKILL)
        served = _served_rewards(server["url"], result["calls"])
    texts, in_process = _in_process_rewards(kb, tokenizer, result["calls"])
    return {**result, "served": served, "texts": texts, "in_process": in_process, "stopped": stopped,
            "wall_s": time.monotonic() - t0}


def _logged(fit: dict, prefix: str) -> dict[int, dict[str, float]]:
    return {r["step"]: r["metrics"] for r in fit["records"] if r["prefix"] == prefix}


def test_aligners_own_trainer_and_actor_ran_two_steps_with_validation_and_a_checkpoint(fit):
    assert fit["trainer_class"] == "nemo_aligner.algorithms.reinforce.ReinforceTrainer"
    assert fit["actor_class"] == "nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor.MegatronGPTReinforceActorModel"
    # remote_reward_client's class only bounds the communicator's timeouts; infer_rm is Aligner's
    assert "nemo_aligner.models.nlp.gpt.reward_critic_clients.RemoteGPTRMClient" in fit["rm_classes"]
    assert fit["steps"] == 2 and fit["optimizer_steps"] == 2 and fit["consumed_samples"] == 16
    rollouts, optim = _logged(fit, "train_rollouts/"), _logged(fit, "train_optim/")
    assert sorted(rollouts) == [0, 1] and sorted(optim) == [0, 1]
    assert sorted(_logged(fit, "val_rollouts/")) == [1, 2]  # val_check_interval=1: after each step
    for step in (0, 1):
        assert rollouts[step]["rollout_size"] == 8  # 2 prompts × num_rollouts_per_prompt=4
        assert math.isfinite(optim[step]["loss"]) and optim[step]["grad_norm"] > 0
    # the initial-policy KL is 0 before the first update and positive after it: the optimiser step moved the actor
    assert rollouts[0]["init_policy_kl"] == 0 and rollouts[1]["init_policy_kl"] > 0
    calls = fit["calls"]
    assert [(c["phase"], c["step"]) for c in calls] == [("train", 0)] * 4 + [("val", 1)] + [("train", 1)] * 4 + [("val", 2)]
    assert any(f.endswith("-last/metadata.json") for f in fit["files"])  # the custom checkpoint callback saved
    assert any(f.startswith("events.out.tfevents") for f in fit["files"])  # exp_manager's TensorBoard logger got them


def test_logged_rewards_are_the_servers_and_the_servers_are_factaligns(fit):
    calls = fit["calls"]
    got = [c["rewards"] for c in calls]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(fit["served"]), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(fit["in_process"]), rtol=0, atol=1e-6)
    for phase, prefix, steps in (("train", "train_rollouts/", (0, 1)), ("val", "val_rollouts/", (1, 2))):
        logged = _logged(fit, prefix)
        for step in steps:
            rewards = [r for c in calls if c["phase"] == phase and c["step"] == step for r in c["rewards"]]
            assert logged[step]["rewards"] == pytest.approx(float(np.mean(rewards)), abs=1e-6)
    train = [r for c in calls if c["phase"] == "train" for r in c["rewards"]]
    assert all(math.isfinite(r) for r in train) and len(set(np.round(train, 6))) >= 2 and max(train) > 0


def test_known_answers_get_their_known_rewards(fit):
    """Most sampled responses are sentences the policy was taught; each earns its hand-computed f1@10."""
    pairs = [(text, reward) for texts, call in zip(fit["texts"], fit["calls"], strict=True)
             for text, reward in zip(texts, call["rewards"], strict=True)]
    known = [(text, reward) for text, reward in pairs if text in KNOWN]
    assert len(known) >= len(pairs) // 2, pairs
    for text, reward in known:
        assert reward == pytest.approx(KNOWN[text], abs=1e-6), text
    assert {KNOWN[t] > 0 for t, _ in known} == {True, False}, known  # true and false answers both appear


def test_nothing_is_left_running(fit):
    stopped = fit["stopped"]
    assert stopped["exit_code"] == 0, stopped["log"]  # SIGTERM stopped the server (and its Triton) cleanly
    assert stopped["left_after_stop"] == {} and stopped["left_after_kill"] == {}, stopped
    assert fit["driver_left"] == {}  # the driver's process group (its checkpoint helper included) had ended
