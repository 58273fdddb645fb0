"""``rollout.engine=vllm`` on the megatron backend, at TP=1 and TP=2: refit works (real vLLM, real Megatron-Core).

Every rank exports the policy (Bridge gathers each weight once); the replica's model-parallel source rank alone holds
the engine, refits it (by file, or at TP=2 also by broadcast: streamed as Bridge yields) and broadcasts the rollouts. Greedy rollouts from the engine are token-identical to the
backend's own static engine at step 0 and again after 3 optimiser steps that changed them, on every rank, and the
engine's log-probs are the trainer's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_factuality.testing.megatron_env import run_in_megatron_venv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
DRIVER = "tests/trainers/megatron_vllm_driver.py"


@pytest.fixture(scope="module")
def policy(megatron_venv, tmp_path_factory) -> Path:
    hf = tmp_path_factory.mktemp("megatron_vllm") / "hf"
    res = run_in_megatron_venv(megatron_venv, [DRIVER, "make-model", f"--hf={hf}", f"--out={hf.parent}"], timeout=120)
    assert res.returncode == 0, res.stdout[-4000:]
    return hf


@pytest.mark.parametrize("tp, refit, tied", [
    (1, "file", False),
    # found by this case: vLLM's in-place reload left a tied output layer at its starting weights (log-probs 2.5 apart
    # after the 3 steps) until the engine re-tied it after every reload (``vllm_worker.retie_output_layers``)
    (2, "file", True),
    (2, "broadcast", False)])
def test_vllm_rollouts_equal_the_native_engines_before_and_after_3_steps(megatron_venv, vllm_python, policy, tmp_path, tp,
                                                                          refit, tied):
    """``refit=broadcast``: the source streams Bridge's export tensor by tensor into the engine (gloo), no file; after
    the 3 steps it streams, then its engine is killed: the rollout request restarts it and every rank streams again
    before the request is repeated (the step-3 rollouts are still the native engine's). ``tied``: a policy whose
    output layer is its embedding (Bridge exports it once; vLLM's Qwen2 reads it for both)."""
    # broadcast: the engine core in processes of its own, as on GPUs (the others: inside, the CPU default); the kill
    # must take those processes with it and the stream must reach workers outside the engine's process
    kill = ["--kill-before-rollout", "--engine-core-process"] if refit == "broadcast" else []
    model = policy.with_name(f"{policy.name}_tied") if tied else policy
    if tied:  # the model really is tied: one tensor for both, none named for the output layer
        assert json.loads((model / "config.json").read_text())["tie_word_embeddings"] is True
    res = run_in_megatron_venv(megatron_venv, [DRIVER, "refit", f"--hf={model}", f"--out={tmp_path}",
                                               f"--vllm-python={vllm_python}", f"--tp={tp}", f"--refit={refit}", *kill],
                               nproc=tp, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:]
    ranks = [json.loads((tmp_path / f"vllm.rank{r}.json").read_text()) for r in range(tp)]
    assert [r["has_engine"] for r in ranks] == [True] + [False] * (tp - 1)  # one engine per replica, on its source
    for r in ranks:
        assert r["step0"] == r["native0"] and r["step3"] == r["native3"]
        assert r["step3"] != r["step0"]  # the 3 steps changed what greedy decoding says: the refit carried them
        assert r["gap0"] < 1e-4 and r["gap3"] < 1e-4, (r["gap0"], r["gap3"])
        # broadcast: step 0's stream, the explicit one after the steps and the one after the restart
        assert r["refits"] == (2 if refit == "file" else 3) and r["step3"] == ranks[0]["step3"]
        assert r["wrote_file"] == (refit == "file" and r["has_engine"])
        # issue 39: a file refit copies the model to host memory on the source alone (two refits here); the other
        # ranks walk the collective export and keep nothing (before: a full copy each, every step)
        assert (r["host_copied_bytes"] > 0) == (refit == "file" and r["has_engine"]), (r["rank"], r["host_copied_bytes"])
    assert ranks[0]["starts"] == (1 if refit == "file" else 2)
    logs = [p.read_text(errors="replace") for p in sorted((tmp_path / "engine0").glob("engine*.log"))]
    assert len(logs) == ranks[0]["starts"]
    for text in logs:  # where vLLM's engine core ran, as configured (its log names the process of each line)
        assert ("(EngineCore pid=" in text) == (refit == "broadcast"), text[-3000:]
