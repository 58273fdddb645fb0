"""Core contracts: types validate their inputs, registries refuse silent overwrites, configs reject typos."""

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from nemo_factuality.config import ConfigError, load_config
from nemo_factuality.registry import Registry, RegistryError
from nemo_factuality.types import Claim, FactualityInputError, Label, RewardBatch, Span, Verdict


def test_span_and_label_validation():
    assert Span(2, 5).slice("abcdefg") == "cde"
    with pytest.raises(FactualityInputError, match="0 <= start <= end"):
        Span(5, 2)
    with pytest.raises(FactualityInputError, match="exceeds text length"):
        Span(0, 10).slice("short")
    assert Label.parse("Supported") is Label.SUPPORTED
    with pytest.raises(FactualityInputError, match="Unknown label 'maybe'"):
        Label.parse("maybe")
    with pytest.raises(FactualityInputError, match="empty text"):
        Claim(id=0, text="   ")
    with pytest.raises(FactualityInputError, match="score must be in"):
        Verdict(claim_id=0, label=Label.SUPPORTED, score=1.5)


def test_reward_batch_shapes_and_adapters():
    rb = RewardBatch(
        scores=[1.0, float("nan")],
        components={"precision": [0.5, float("nan")]},
        token_rewards=[[0.0, 1.0], []],
        token_signs=[[1, -1], []],
    )
    assert rb.to_list() == [1.0, None]
    assert rb.sample_dict(0) == {"score": 1.0, "precision": 0.5}
    assert rb.token_signs[0].dtype == np.int8
    logs = rb.log_dict()
    assert logs["reward/score"] == 1.0 and logs["reward/abstain_frac"] == 0.5
    both = RewardBatch.concat([rb, rb])
    assert len(both) == 4 and math.isnan(both.scores[3])
    with pytest.raises(FactualityInputError, match="component 'x' has 1 values, expected 2"):
        RewardBatch(scores=[0.0, 1.0], components={"x": [1.0]})
    with pytest.raises(FactualityInputError, match=r"token_signs\[0\]"):
        RewardBatch(scores=[0.0], token_signs=[[2]])


def test_registry_refuses_overwrite_and_reports_all_bad_options():
    reg = Registry("widget")

    @reg.register("a")
    def make_a(size: int, color: str = "red"):
        return (size, color)

    assert reg.build({"name": "a", "size": 3}) == (3, "red")
    with pytest.raises(RegistryError, match="already registered"):
        reg.register("a")(lambda: None)
    with pytest.raises(RegistryError, match=r"unknown option\(s\) \['colour'\]; missing required option\(s\) \['size'\]"):
        reg.build({"name": "a", "colour": "blue"})
    with pytest.raises(RegistryError, match="Known widgets: a"):
        reg.build("b")


@dataclass
class _Inner:
    k: int = 1


@dataclass
class _Schema:
    name: str = "x"
    inner: _Inner = field(default_factory=_Inner)


def test_config_overrides_and_typos(tmp_path):
    cfg = load_config(_Schema, overrides=["inner.k=5"])
    assert isinstance(cfg, _Schema) and cfg.inner.k == 5
    with pytest.raises(ConfigError, match="inner.kk"):
        load_config(_Schema, overrides=["inner.kk=5"])
    yaml = tmp_path / "c.yaml"
    yaml.write_text("inner:\n  k: notanint\n")
    with pytest.raises(ConfigError, match="c.yaml"):
        load_config(_Schema, str(yaml))
