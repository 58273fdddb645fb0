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
