"""The methods the lab can train, each through its own stage with its own reward (``lab.method_rewards``).

``--methods all`` (the default) is the five published methods, FSPO in both of its settings; ``slots`` is the
lab's own slot reward (the lab's earlier single method), kept for comparison. Every method starts from the
same base, draws from the same RL prompt pool and gets the same number of policy samples (the stage presets
in ``conf/lab`` are sized so; ``tests/lab/test_train.py`` checks it).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_factuality.types import FactualityInputError


@dataclass(frozen=True)
class LabMethod:
    name: str
    title: str  # the report's row label
    stage: str  # grpo | ppo | kto
    reward: dict[str, Any] = field(default_factory=dict)  # the reward spec, without store_path / tokenizer
    columns: tuple[str, ...] = ()  # prompt columns the reward reads: checklist, ground_truth, topic


METHODS: dict[str, LabMethod] = {m.name: m for m in (
    LabMethod("klcf", "KLCF: GRPO, checklist recall + claim truthfulness", "grpo", {"name": "lab_klcf"}, ("checklist",)),
    LabMethod("fspo_code", "FSPO, released code: GRPO + step-sign flip, answer F1", "grpo",
              {"name": "lab_fspo", "fact_weight": 0.0, "outside_mask": 1, "step_labels": "binary"}, ("ground_truth",)),
    LabMethod("fspo_paper", "FSPO, paper: GRPO + step-sign flip, answer F1 + step score", "grpo",
              {"name": "lab_fspo", "fact_weight": 1.0, "outside_mask": 0, "step_labels": "three_way"}, ("ground_truth",)),
    LabMethod("knowrl", "KnowRL: GRPO, format + correctness + KB facts", "grpo", {"name": "lab_knowrl"},
              ("ground_truth", "topic")),
    LabMethod("rlfh", "RLFH: PPO + critic, token rewards", "ppo", {"name": "lab_rlfh"}),
    LabMethod("factalign", "FactAlign: iterated KTO + fKTO", "kto", {"name": "lab_factalign"}),
    LabMethod("slots", "lab slot reward: GRPO + value-word signs (not a published method)", "grpo",
              {"name": "lab_slots", "wrong_penalty": 1.0, "mode": "dual"}),
)}
# What training may change (``--trainable``): the tiny policy's scopes (lab/train.py) and a real policy's (lab/real_policy.py)
TRAINABLE = ("calibration", "abstention", "all")
REAL_TRAINABLE = ("top_layers", "lora")
GROUPS: dict[str, tuple[str, ...]] = {
    "all": ("klcf", "fspo_code", "fspo_paper", "knowrl", "rlfh", "factalign"),
    "fspo": ("fspo_code", "fspo_paper"),
}


def stage_schema(stage: str) -> type:
    from nemo_factuality.trainers.config import GRPOConfig, KTOConfig, PPOConfig

    return {"grpo": GRPOConfig, "ppo": PPOConfig, "kto": KTOConfig}[stage]


def load_stage_config(stage: str, preset: str, overrides: Sequence[str]) -> Any:
    """``conf/lab/<preset>.yaml`` over the stage's schema, plus ``key=value`` overrides, validated."""
    from nemo_factuality.config import load_config
    from nemo_factuality.trainers.config import validate_train_config

    cfg = load_config(stage_schema(stage), preset, list(overrides), group="lab")
    validate_train_config(cfg)
    return cfg


def select_methods(text: str) -> tuple[str, ...]:
    """``"all"``, ``"klcf,fspo"`` … → method names in the registry's order, each once."""
    picked: set[str] = set()
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        if word in GROUPS:
            picked.update(GROUPS[word])
        elif word in METHODS:
            picked.add(word)
        else:
            raise FactualityInputError(f"--methods: unknown method {word!r}; choose from {', '.join([*GROUPS, *METHODS])}")
    if not picked:
        raise FactualityInputError("--methods: name at least one method (or 'all')")
    return tuple(m for m in METHODS if m in picked)


def route_overrides(overrides: Sequence[str], methods: Sequence[str]) -> dict[str, tuple[list[str], dict[str, Any]]]:
    """``[method:]key=value`` words → each selected method's (stage overrides, reward options).

    ``reward.<option>=value`` changes the method's reward spec; anything else is a key of the method's stage
    config. A word without ``method:`` goes to every selected method whose stage config (or reward) has that
    key, and is an error when none has it; ``method:`` words go to that method only.
    """
    out: dict[str, tuple[list[str], dict[str, Any]]] = {m: ([], {}) for m in methods}
    for word in overrides:
        head, sep, rest = word.partition(":")
        scoped = bool(sep) and "=" not in head
        if scoped and head not in METHODS:
            raise FactualityInputError(f"override {word!r}: {head!r} is not a method ({', '.join(METHODS)})")
        if scoped and head not in out:
            raise FactualityInputError(f"override {word!r}: method {head!r} is not selected by --methods")
        text = rest if scoped else word
        if "=" not in text or text.startswith("="):
            raise FactualityInputError(f"override {word!r}: overrides look like [method:]key=value")
        targets = [head] if scoped else list(methods)
        key, _, value = text.partition("=")
        if key.startswith("reward."):
            _route_reward(word, key.removeprefix("reward."), value, targets, out, scoped)
        else:
            _route_stage(word, text, targets, out, scoped)
    return out


def _route_stage(word: str, text: str, targets: list[str], out: dict, scoped: bool) -> None:
    from nemo_factuality.config import ConfigError, load_config

    errors: dict[str, ConfigError] = {}
    for stage in sorted({METHODS[m].stage for m in targets}):
        try:
            load_config(stage_schema(stage), None, [text])
        except ConfigError as err:
            errors[stage] = err
    accepted = [m for m in targets if METHODS[m].stage not in errors]
    if not accepted or (scoped and errors):
        stage, err = next(iter(errors.items()))
        raise ConfigError(f"override {word!r} ({stage} stage): {err}")
    for m in accepted:
        out[m][0].append(text)


def _route_reward(word: str, option: str, value: str, targets: list[str], out: dict, scoped: bool) -> None:
    from omegaconf import OmegaConf

    from nemo_factuality.config import parse_override
    from nemo_factuality.registry import REWARDS

    parsed = None
    if value:  # parsed as every override is (YAML); a malformed value is a one-line error naming the override
        node = OmegaConf.select(parse_override(word.partition(":")[2] if scoped else word), f"reward.{option}")
        parsed = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    accepted = [m for m in targets if _takes(REWARDS.get(METHODS[m].reward["name"]), option)]
    if not accepted or (scoped and len(accepted) < len(targets)):
        names = sorted({METHODS[m].reward["name"] for m in targets})
        raise FactualityInputError(f"override {word!r}: the reward of {', '.join(targets)} ({', '.join(names)}) has no "
                                   f"option {option!r}")
    for m in accepted:
        out[m][1][option] = parsed


def _takes(factory: Any, option: str) -> bool:
    """Whether a reward factory has the option (the store, the tokenizer and the world are the lab's to set)."""
    if option in ("store_path", "tokenizer", "world"):
        return False
    params = inspect.signature(factory).parameters
    return option in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def check_overrides(overrides: Sequence[str], methods: Sequence[str], presets: dict[str, str]) -> None:
    """Every override against every selected method's stage config and reward, before any work is done."""
    from nemo_factuality.lab.method_rewards import check_reward_options

    for name, (stage_ovr, reward_ovr) in route_overrides(overrides, methods).items():
        m = METHODS[name]
        load_stage_config(m.stage, presets[m.stage], ["model.path=/base", "remote_rm.url=http://127.0.0.1:1", *stage_ovr])
        check_reward_options({**m.reward, **reward_ovr})
