"""``model.hf_generation=compiled`` (``backends/hf/compiled.py``): the hf backend's rollouts with a static KV cache and
a ``torch.compile``'d decoding forward, against eager ``generate`` on the tiny policy.

Greedy tokens equal eager's for prompts of 3–9 tokens in a chunk smaller than ``model.rollout_micro_batch_size`` (the
filler rows are dropped); a second call whose prompts fall in the same width bucket traces no new graph, one with a
prompt past the bucket traces one and logs it. On CPU the graphs are traced by dynamo and run with the ``eager``
backend (``COMPILE_BACKEND``; inductor's code generation takes about a minute here and is not what these checks are
about); the shapes, the static cache and the graph count are the production path's.
"""

from __future__ import annotations

import logging

import pytest
import torch

from nemo_factuality.trainers.backends.hf import compiled
from nemo_factuality.trainers.backends.hf.actor import HFActor
from nemo_factuality.trainers.config import GRPOConfig
from nemo_factuality.trainers.interfaces import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, use_greedy=True)


def _actor(policy, generation: str) -> HFActor:
    cfg = GRPOConfig()
    cfg.model.path, cfg.model.hf_generation, cfg.model.rollout_micro_batch_size = str(policy), generation, 4
    return HFActor(cfg.model, max_steps=1)


def test_compiled_greedy_rollouts_equal_eager_and_graphs_follow_the_width_buckets(tiny_policy, monkeypatch, caplog):
    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    eager, fast = _actor(tiny_policy, "eager"), _actor(tiny_policy, "compiled")
    first = [[5, 17, 33], [9, 60, 2, 44, 31, 18, 77, 3, 12]]  # 2 prompts: 2 filler rows up to the 4 a chunk holds
    same_bucket = [[120, 7, 7, 41, 300], [2, 44, 31, 8, 9, 10, 11]]
    longer = [[7] * 70]  # past the first 64-token bucket
    with caplog.at_level(logging.INFO, logger="nemo_factuality.trainers.backends.hf.compiled"):
        for prompts, expect_new in ((first, True), (same_bucket, False), (longer, True)):
            before = fast._graphs.graphs
            got, want = fast.generate(prompts, GREEDY), eager.generate(prompts, GREEDY)
            assert got.tokens.tolist() == want.tokens.tolist() and len(got) == len(prompts)
            assert got.response_lengths.tolist() == want.response_lengths.tolist()
            assert (fast._graphs.graphs > before) == expect_new, (prompts, before, fast._graphs.graphs)
    traced = [r.getMessage() for r in caplog.records if "traced" in r.getMessage()]
    assert len(traced) == 2 and "4 rows × 64 prompt tokens" in traced[0] and "4 rows × 128" in traced[1], traced


def test_compiled_is_the_hf_backends_own_generate_only():
    from nemo_factuality.trainers.config import load_train_config

    with pytest.raises(Exception, match="model.hf_generation=compiled is the hf backend's own generate"):
        load_train_config(GRPOConfig, None, ["model.path=/nonexistent", "trainer.backend=megatron",
                                             "model.hf_generation=compiled", "remote_rm.url=http://127.0.0.1:9"])


def test_validation_generates_in_the_rollouts_chunks_and_traces_no_graph_of_its_own(tiny_policy, tmp_path, monkeypatch,
                                                                                    caplog):
    """Issue 50, item 8: validation generated every validation prompt in one batch — with hf_generation=compiled a
    batch shape of its own, so a new compiled graph and static cache beside the rollouts' (on a GPU, a second graph
    pool held through training). Now it generates in chunks of model.rollout_micro_batch_size: 10 validation prompts
    in chunks of 4 trace only 4-row graphs, as the step's rollouts do (before: one for 10 rows)."""
    from nemo_factuality.testing.training import good_fraction, grpo_test_config, prompts
    from nemo_factuality.trainers.grpo import GRPOTrainer

    monkeypatch.setattr(compiled, "COMPILE_BACKEND", "eager")
    torch._dynamo.reset()  # graphs an earlier test traced for the same shapes would be reused, and none logged here
    cfg = grpo_test_config(tiny_policy, tmp_path / "run", steps=2, **{
        "model.hf_generation": "compiled", "model.rollout_micro_batch_size": 4, "grpo.num_prompts_per_step": 2,
        "grpo.num_rollouts_per_prompt": 4, "model.global_batch_size": 8, "trainer.val_check_interval": 1,
        "data.apply_chat_template": False})
    actor = HFActor(cfg.model, max_steps=2)
    shapes = []
    generate = actor.generate
    actor.generate = lambda ids, sampling: shapes.append(len(ids)) or generate(ids, sampling)
    trainer = GRPOTrainer(cfg, actor, good_fraction, prompts(4), run_dir=tmp_path / "run", val_data=prompts(10))
    records = []  # on the module's logger itself: an earlier test may have stopped nemo_factuality's propagating
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    graph_log = logging.getLogger("nemo_factuality.trainers.backends.hf.compiled")
    graph_log.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger=graph_log.name):
            history = trainer.fit()
    finally:
        graph_log.removeHandler(handler)
    assert len(history) == 2 and all("val/reward" in m for m in history)
    assert max(shapes) == 4 and len(shapes) > 4, shapes  # every call a chunk of at most 4 prompts, validation's too
    traced = [r.getMessage() for r in records if "traced" in r.getMessage()]
    assert traced and all(" for 4 rows × " in t for t in traced), traced  # sampling's and greedy's, both 4 rows
