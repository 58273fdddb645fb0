"""``nemo-factuality serve`` builds each method's reward as the stages need it (no server started here)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from nemo_factuality.config import conf_dir, load_config
from nemo_factuality.serving.config import ServeConfig

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
