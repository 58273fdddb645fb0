"""Every shipped YAML loads into its typed schema (recursively), and every reward config names a registered reward."""

from pathlib import Path

import pytest

from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.evaluation.cli import EvalConfig
from nemo_factuality.registry import EVIDENCE, EXTRACTORS, REWARDS, VERIFIERS
from nemo_factuality.serving.config import ServeConfig

SERVE = sorted((REPO_ROOT / "conf" / "serve").rglob("*.yaml"))
EVAL = sorted((REPO_ROOT / "conf" / "eval").rglob("*.yaml"))


def _left_to_the_user(node, prefix=""):
    """Dotted keys a YAML leaves as ``???`` (the user must set them on the command line)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _left_to_the_user(value, f"{prefix}{key}.")
    elif node == "???":
        yield prefix[:-1]


@pytest.mark.parametrize("path", SERVE, ids=lambda p: p.stem)
def test_serve_configs(path: Path):
    from omegaconf import OmegaConf

    required = list(_left_to_the_user(OmegaConf.to_container(OmegaConf.load(path))))
    cfg = load_config(ServeConfig, str(path), [f"{k}=/placeholder" for k in required])
    assert cfg.reward["name"] in REWARDS
    pipe = cfg.reward.get("pipeline", {})
    for key, registry in (("extractor", EXTRACTORS), ("evidence", EVIDENCE), ("verifier", VERIFIERS)):
        if key in pipe:
            assert pipe[key]["name"] in registry


@pytest.mark.parametrize("path", EVAL, ids=lambda p: p.stem)
def test_eval_configs(path: Path):
    from omegaconf import OmegaConf

    raw = OmegaConf.to_container(OmegaConf.load(path))
    assert set(raw) <= {"pipeline", "topic_field", "materials_field"}
    for key, registry in (("extractor", EXTRACTORS), ("evidence", EVIDENCE), ("verifier", VERIFIERS)):
        assert raw["pipeline"][key]["name"] in registry


def test_schema_rejects_typos():
    from nemo_factuality.config import ConfigError

    with pytest.raises(ConfigError, match="htp_port"):
        load_config(ServeConfig, None, ["htp_port=1"])
    assert isinstance(load_config(EvalConfig, None, ["topic_field=title"]), EvalConfig)


def test_choosing_another_component_replaces_its_block_and_nothing_else(tmp_path):
    """Issue 54 item 3: a component block is a choice (Hydra's config-group way). Before: the old verifier's
    model_path / threshold / entail_label stayed under kb_exact, and a whole-block override merged into the old block."""
    from nemo_factuality.trainers.config import GRPOConfig, PPOConfig

    def verifier(*overrides):
        return load_config(GRPOConfig, "knowrl", list(overrides), group="train").reward["pipeline"]["verifier"]

    assert verifier("reward.pipeline.verifier.name=kb_exact") == {"name": "kb_exact"}
    # what the command line gives the block stays, whichever side of the choice it is written on
    for order in ((0, 1), (1, 0)):
        words = ["reward.pipeline.verifier.name=kb_exact", "reward.pipeline.verifier.store_path=kb.sqlite"]
        assert verifier(*(words[i] for i in order)) == {"name": "kb_exact", "store_path": "kb.sqlite"}
    assert verifier("reward.pipeline.verifier={name: kb_exact, store_path: kb.sqlite}") == {"name": "kb_exact",
                                                                                             "store_path": "kb.sqlite"}
    # the same component again, or an option of it: the block is kept and the key set (the file's 0.3 → 0.5)
    assert verifier("reward.pipeline.verifier.name=nli", "reward.pipeline.verifier.threshold=0.5") == {
        "name": "nli", "model_path": "/models/DeBERTa-v3-base-mnli-fever-anli", "threshold": 0.5,
        "entail_label": "entailment"}
    cfg = load_config(GRPOConfig, "knowrl", ["reward.pipeline.evidence.name=none"], group="train")
    assert cfg.reward["pipeline"]["evidence"] == {"name": "none"} and cfg.reward["pipeline"]["verifier"]["name"] == "nli"
    assert cfg.reward["judge"]["model"] == "gpt-4o-mini-compatible-judge"  # the blocks beside it untouched
    # a block that is not a component (a judge, NeMo's model overrides) still merges key by key
    cfg = load_config(GRPOConfig, "knowrl", ["reward.judge={base_url: 'http://j:1/v1'}"], group="train")
    assert cfg.reward["judge"] == {"base_url": "http://j:1/v1", "model": "gpt-4o-mini-compatible-judge", "concurrency": 64}
    ppo = load_config(PPOConfig, "rlfh", ["critic.model_overrides={optim: {name: sgd, lr: 0.1}}",
                                          "critic.model_overrides.optim.name=adamw"], group="train")
    assert ppo.critic.model_overrides["optim"] == {"name": "adamw", "lr": 0.1}
    # the same rule where a YAML goes over its `defaults:` (before: the lab reward got knowrl's judge and pipeline)
    (tmp_path / "mine.yaml").write_text("defaults: [knowrl]\nreward: {name: lab_knowrl, store_path: kb.sqlite}\n")
    cfg = load_config(GRPOConfig, str(tmp_path / "mine.yaml"), [], group="train")
    assert cfg.reward == {"name": "lab_knowrl", "store_path": "kb.sqlite"} and cfg.grpo.num_rollouts_per_prompt == 10
