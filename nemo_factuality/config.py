"""Typed config loading: a dataclass schema holds every default; YAML and CLI overrides change it.

``load_config(Schema, "klcf", ["reward.weights.recall=2.0"], group="serve")`` reads
``conf/serve/klcf.yaml`` on top of ``Schema()`` and applies Hydra-style ``key=value``
overrides. A YAML may start with ``defaults: [other]`` to build on ``conf/<group>/other.yaml``. Unknown keys anywhere raise ``ConfigError`` naming the key and the file, so a typo
never runs silently with a default.

A component block (``COMPONENT_BLOCKS``: a method reward, a pipeline part — the blocks a registry builds by ``name``)
is a choice, as a Hydra config group is: an override choosing another component (``reward.pipeline.verifier.name=
kb_exact``) replaces the block with ``{name: kb_exact}`` and the options the command line gives that block (before or
after the choice), so the old component's options do not reach the new one; a whole-block override
(``'reward.pipeline.verifier={name: kb_exact, store_path: kb.sqlite}'``) replaces the block too. Any other override
sets its key, and a mapping value merges into the block there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[1]


class ConfigError(ValueError):
    """A config file or override does not fit its schema."""


def conf_dir() -> Path:
    """Directory holding the YAML configs (``$NEMO_FACTUALITY_CONF`` or the repo's ``conf/``)."""
    return Path(os.environ.get("NEMO_FACTUALITY_CONF", REPO_ROOT / "conf"))


def resolve_config_path(config_name: str, group: str | None = None) -> Path:
    """Find ``config_name`` as a path, or as ``conf/<group>/<config_name>.yaml``."""
    direct = Path(config_name)
    if direct.suffix in (".yaml", ".yml") and direct.exists():
        return direct
    base = conf_dir() / group if group else conf_dir()
    candidate = base / f"{config_name}.yaml"
    if candidate.exists():
        return candidate
    available = sorted(p.stem for p in base.glob("*.yaml")) if base.exists() else []
    raise ConfigError(f"Config {config_name!r} not found at {candidate}. Available in {base}: {available or '(none)'}")


def load_config(
    schema: type[T] | T,
    config_name: str | None = None,
    overrides: Sequence[str] = (),
    *,
    group: str | None = None,
) -> T:
    """Merge schema defaults ← YAML ← ``key=value`` overrides; return a typed object (schema instance)."""
    if not (is_dataclass(schema)):
        raise TypeError(f"schema must be a dataclass type or instance, got {schema!r}")
    merged: DictConfig = OmegaConf.structured(schema)
    source = "schema defaults"
    try:
        if config_name:
            path = resolve_config_path(config_name, group)
            source = str(path)
            merged = merge_layers(merged, _load_with_defaults(path, group, ()))
        bad = [o for o in overrides if "=" not in o]
        if bad:
            raise ConfigError(f"Overrides must look like key=value, got {bad}")
        base_source = source
        for i, override in enumerate(overrides):  # one at a time, so an error names the override it comes from
            source = f"override {override!r}"
            merged = apply_override(merged, override, overrides[:i])
        source = f"{base_source} with the command-line overrides" if overrides else base_source
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except ConfigKeyError as err:  # a typo in a key: name it and the closest valid keys
        raise ConfigError(f"unknown config key {getattr(err, 'full_key', None) or err} in {source}"
                          f"{_close_keys(err)}") from err
    except MissingMandatoryValue as err:  # a "???" in the YAML: the user has to supply it
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError(f"{key} has no value: add {key}=... to the command line "
                          f"(config {config_name or 'defaults'} leaves it to you)") from err
    except OmegaConfBaseException as err:  # a value of the wrong type: name the key, drop OmegaConf's debug lines
        reason = str(getattr(err, "msg", None) or err).splitlines()[0]
        key = getattr(err, "full_key", None)
        raise ConfigError(f"Invalid config from {source}: {f'{key}: ' if key else ''}{reason}") from err


#: The free-form blocks a registry builds by ``name`` (registry.py: REWARDS, SEGMENTERS, EXTRACTORS, EVIDENCE,
#: VERIFIERS), by their key: choosing another component replaces the block (``apply_override``).
COMPONENT_BLOCKS = frozenset({"reward", "segmenter", "extractor", "evidence", "verifier"})


def apply_override(merged: DictConfig, override: str, earlier: Sequence[str] = ()) -> DictConfig:
    """``merged`` with one ``key=value`` override applied (``earlier``: the overrides applied before it).

    Choosing another component of a ``COMPONENT_BLOCKS`` block replaces that block: ``X.name=other`` with
    ``{name: other}`` plus what the ``earlier`` overrides set inside ``X``, ``X={...}`` with that mapping. Anything else
    merges in (OmegaConf's rules: a typed key checked against its schema)."""
    parsed = parse_override(override)
    key = override.split("=", 1)[0].lstrip("+")
    block_key, _, leaf = key.rpartition(".")
    if leaf == "name" and _is_component_block(merged, block_key):
        new_name = OmegaConf.select(parsed, key)
        if new_name != OmegaConf.select(merged, block_key).get("name"):
            OmegaConf.update(merged, block_key, {"name": new_name}, merge=False)
            for prior in earlier:  # what the command line set inside the block stays, in its order
                prior_key = prior.split("=", 1)[0].lstrip("+")
                if prior_key.startswith(f"{block_key}.") and prior_key != key:
                    merged = OmegaConf.merge(merged, parse_override(prior))
            return merged
    value = OmegaConf.select(parsed, key)
    if isinstance(value, DictConfig) and _is_component_block(merged, key):
        OmegaConf.update(merged, key, value, merge=False)
        return merged
    return OmegaConf.merge(merged, parsed)


def merge_layers(base: DictConfig, top: DictConfig) -> DictConfig:
    """``top`` merged over ``base`` (a YAML over its ``defaults:``, a YAML over the schema), with the override rule for
    component blocks: a block of ``top`` that names another component than ``base``'s replaces it."""
    for key, name in _named_blocks(OmegaConf.to_container(top, resolve=False)):
        if _is_component_block(base, key) and OmegaConf.select(base, key).get("name") != name:
            OmegaConf.update(base, key, {}, merge=False)
    return OmegaConf.merge(base, top)


def _named_blocks(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, component name) of each ``COMPONENT_BLOCKS`` block in ``tree`` (a plain container) naming one."""
    out = []
    for key, value in tree.items() if isinstance(tree, dict) else ():
        if isinstance(value, dict):
            if key in COMPONENT_BLOCKS and "name" in value:
                out.append((f"{prefix}{key}", value["name"]))
            out += _named_blocks(value, f"{prefix}{key}.")
    return out


def _is_component_block(merged: DictConfig, key: str) -> bool:
    """``key`` names a free-form (untyped) block of ``COMPONENT_BLOCKS`` present in ``merged``."""
    if key.rpartition(".")[2] not in COMPONENT_BLOCKS:
        return False
    node = OmegaConf.select(merged, key, throw_on_missing=False)
    return isinstance(node, DictConfig) and OmegaConf.get_type(node) is dict


def parse_override(override: str) -> DictConfig:
    """``key=value`` → a one-key config (the value parsed as YAML: ``[1, 2]``, ``{a: 1}``, ``null``, ``3e-4``);
    a value YAML cannot read is a ``ConfigError`` naming the override."""
    try:
        return OmegaConf.from_dotlist([override.lstrip("+")])
    except yaml.YAMLError as err:
        value = override.split("=", 1)[1]
        raise ConfigError(f"override {override!r}: cannot parse the value {value!r} ({_yaml_problem(err)}); values are "
                          "YAML: [1, 2], {a: 1}, null, 3e-4; quote a string that looks like one") from err


def _yaml_problem(err: yaml.YAMLError) -> str:
    """The one-line reason of a YAML error (PyYAML's message spans several lines with a caret)."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    if mark is None:
        return str(problem)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark.line else f"{problem} at column {mark.column + 1}"


def _load_with_defaults(path: Path, group: str | None, chain: tuple[Path, ...]) -> DictConfig:
    """A YAML file with Hydra-style ``defaults: [base, ...]`` (names in the same group) merged underneath it."""
    if path in chain:
        raise ConfigError(f"config {path} includes itself through defaults: {' -> '.join(map(str, chain + (path,)))}")
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as err:
        raise ConfigError(f"config {path} is not valid YAML: {_yaml_problem(err)}") from err
    bases = node.pop("defaults", None) if isinstance(node, DictConfig) else None
    if bases is None:
        return node
    if isinstance(bases, str):
        bases = [bases]
    merged = OmegaConf.create({})
    for base in bases:
        merged = merge_layers(merged, _load_with_defaults(resolve_config_path(str(base), group), group, chain + (path,)))
    return merge_layers(merged, node)


def _close_keys(err: ConfigKeyError) -> str:
    """``"; did you mean 'actor_nodes'?"`` when the schema at the failing level has a similar field name."""
    from dataclasses import fields

    schema = getattr(err, "object_type", None)
    key = str(getattr(err, "key", "") or "")
    if not (is_dataclass(schema) and key):
        return ""
    return did_you_mean(key, [f.name for f in fields(schema)])


def did_you_mean(key: str, names: Sequence[str]) -> str:
    """``"; did you mean 'max_steps'?"`` for the names close to ``key``, else the valid names."""
    import difflib

    close = difflib.get_close_matches(key, names, n=3)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else f"; valid keys here: {', '.join(names)}"


def options_for(schema: type, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``options`` for the dataclass ``schema`` (a free-form config block such as a reward's), checked first: an
    unknown key is one ``ConfigError`` naming it under ``where`` with a did-you-mean, as a typo in a typed schema
    is, never a ``TypeError`` from the constructor."""
    from dataclasses import MISSING, fields

    names = [f.name for f in fields(schema)]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(f"unknown config key {where}.{unknown[0]}{did_you_mean(unknown[0], names)}")
    for f in fields(schema):  # a nested block (a reward's guards) is checked against its own schema
        if f.default_factory is not MISSING and is_dataclass(f.default_factory) and isinstance(options.get(f.name), Mapping):
            options_for(f.default_factory, options[f.name], f"{where}.{f.name}")
    return dict(options)


def to_yaml(cfg: Any) -> str:
    """Render a config object (dataclass or DictConfig) as YAML for logs and run directories."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg) if is_dataclass(cfg) else cfg)


def merge_tree(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict:
    """``base`` with ``extra`` merged in, nested mappings key by key (``extra`` wins): how a model preset's method
    section goes on top of its ``common`` block (``trainers/presets.py``, ``launch/layout.py``)."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge_tree(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


def dotlist(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """A nested mapping as ``a.b=value`` overrides (lists as JSON), as ``load_config`` takes them."""
    out = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out += dotlist(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={json.dumps(value) if isinstance(value, list) else value}")
    return out
