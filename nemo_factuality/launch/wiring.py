"""Point every endpoint a served reward uses at a server the job starts, and check it at render time.

A reward server's command ends with ``nemo-factuality serve --config-name NAME [key=value ...]``. The launcher
reads that config as the server will (``conf/serve/NAME.yaml`` under the command's overrides) and finds every
block that names an endpoint: an OpenAI judge block (``base_url``; a role block without one inherits the shared
``reward.judge``'s) or a served general RM (``kind: remote``, ``url``). Each such block must be in the
``serves:`` of a server of the job; the launcher then appends ``<block>.base_url=${<SERVER>_URL}/v1`` (or
``<block>.url=${<SERVER>_URL}``) to the reward server's command. A block no server serves is an error naming
its key, so the reward never health-checks a judge on 127.0.0.1 that nobody started. A judge's
``{served_model_name}`` is the ``model`` its blocks ask for, so vLLM answers under the name the reward sends.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nemo_factuality.config import ConfigError, load_config, resolve_config_path
from nemo_factuality.launch.config import ServerSpec

_OPERATORS = {"&&", "||", ";", "|", "&", "\n"}
_SERVED_NAME = re.compile(r"--served-model-name(?:=|\s+)(\S+)")


@dataclass
class Wiring:
    """What the launcher adds: overrides per reward server, the served model name per server, and problems."""

    overrides: dict[str, list[str]] = field(default_factory=dict)  # reward server name -> words to append
    served_model_names: dict[str, str] = field(default_factory=dict)  # server name -> model name
    problems: list[str] = field(default_factory=list)


def serve_invocation(command: str) -> tuple[str | None, list[str]] | None:
    """``(config name, key=value overrides)`` of the ``nemo-factuality serve`` a command runs; None if it runs none.

    Raises ``ValueError`` when ``serve`` is not the command's last step (the launcher appends to it).
    """
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for word in lexer:
        if word in _OPERATORS:
            segments.append([])
        else:
            segments[-1].append(word)
    segments = [s for s in segments if s]
    found = [i for i, s in enumerate(segments) if _is_serve(s)]
    if not found:
        return None
    if found[-1] != len(segments) - 1:
        raise ValueError("its command must end with the `nemo-factuality serve ...` invocation (the launcher appends "
                         "the judges' URLs to it)")
    words = segments[-1][segments[-1].index("serve") + 1:]
    name = None
    for i, word in enumerate(words):
        if word == "--config-name" and i + 1 < len(words):
            name = words[i + 1]
        elif word.startswith("--config-name="):
            name = word.split("=", 1)[1]
    return name, [w for w in words if "=" in w and not w.startswith("-")]


def _is_serve(words: Sequence[str]) -> bool:
    words = list(words[1:]) if words and words[0] == "exec" else list(words)
    return len(words) >= 2 and words[0].endswith("nemo-factuality") and words[1] == "serve"


def endpoint_blocks(node: Any, prefix: str = "reward") -> dict[str, dict]:
    """Dotted key -> block for every block of a reward config that names an endpoint (``base_url`` or ``url``)."""
    found: dict[str, dict] = {}
    if isinstance(node, Mapping):
        if "base_url" in node or "url" in node:
            found[prefix] = dict(node)
        for key, value in node.items():
            found.update(endpoint_blocks(value, f"{prefix}.{key}"))
    return found


def block_at(reward: Mapping[str, Any], key: str) -> Any:
    """The block at dotted ``key`` (``reward.pipeline.extractor.judge``) of a reward config, or None."""
    node: Any = {"reward": reward}
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _is_general_rm(block: Mapping[str, Any]) -> bool:
    return "url" in block or block.get("kind") == "remote"


def _reward_config(spec: ServerSpec) -> tuple[str, dict[str, Any]] | None:
    """(the config's path, its reward block) as the server will load it; None when the command runs no ``serve``."""
    from nemo_factuality.serving.config import ServeConfig

    try:
        invocation = serve_invocation(spec.command)
    except ValueError as err:
        raise ConfigError(f"reward server {spec.name!r}: {err}") from None
    if invocation is None:
        return None
    name, overrides = invocation
    where = str(resolve_config_path(name, "serve")) if name else "ServeConfig defaults"
    try:
        cfg = load_config(ServeConfig, name, overrides, group="serve")
    except ConfigError as err:
        raise ConfigError(f"reward server {spec.name!r} ({where}): {err}") from None
    return where, asdict(cfg)["reward"] or {}


def wire(servers: Sequence[ServerSpec]) -> Wiring:
    """Overrides and served model names that connect the endpoint blocks of every ``nemo-factuality serve`` among
    ``servers`` (commands with their placeholders filled) to the servers whose ``serves`` name them."""
    out = Wiring()
    configs: dict[str, tuple[str, dict[str, Any]]] = {}
    for spec in servers:
        try:
            loaded = _reward_config(spec)
        except ConfigError as err:
            out.problems.append(str(err))
            continue
        if loaded is not None:
            configs[spec.name] = loaded
    served_by: dict[str, ServerSpec] = {}
    for spec in servers:
        for key in spec.serves:
            if key in served_by:
                out.problems.append(f"{key} is in the serves: of both {served_by[key].name!r} and {spec.name!r}")
            served_by[key] = spec
    for owner, (where, reward) in configs.items():
        for key, block in endpoint_blocks(reward).items():
            if key not in served_by:
                url = block.get("url") or block.get("base_url")
                out.problems.append(f"reward server {owner!r} ({where}): {key}.{'url' if 'url' in block else 'base_url'} "
                                    f"= {url} is served by no het group of the job: add {key} to the serves: of the "
                                    "server that runs it")
    for spec in servers:
        models = set()
        for key in spec.serves:
            holders = [(owner, where, block_at(reward, key)) for owner, (where, reward) in configs.items()
                       if isinstance(block_at(reward, key), Mapping)]
            if not holders:
                out.problems.append(f"server {spec.name!r} serves {key}, which no reward server's config has")
                continue
            for owner, where, block in holders:
                reward = configs[owner][1]
                if block.get("kind") == "hf":
                    out.problems.append(f"server {spec.name!r} serves {key}, but {where} loads it in-process (kind: hf)")
                    continue
                var = "${" + envname(spec.name) + "_URL}"
                general = _is_general_rm(block)
                out.overrides.setdefault(owner, []).append(f"{key}.url={var}" if general else f"{key}.base_url={var}/v1")
                if not general:
                    shared = reward.get("judge") if isinstance(reward.get("judge"), Mapping) else {}
                    models.add(block.get("model") or shared.get("model"))
        models.discard(None)
        if len(models) > 1:
            out.problems.append(f"server {spec.name!r} serves blocks asking for different models ({', '.join(sorted(models))}); "
                                "one server answers under one name: split them over two servers")
        elif models:
            out.served_model_names[spec.name] = models.pop()
    return out


def served_name_problems(spec: ServerSpec, command: str, wanted: str | None) -> list[str]:
    """A vLLM server must answer under the name the reward asks for (``--served-model-name``)."""
    given = _SERVED_NAME.findall(command)
    if wanted and given and given[-1].strip("'\"") != wanted:
        return [f"server {spec.name!r} runs --served-model-name {given[-1]} but the reward asks for model {wanted!r}"]
    if wanted and not given and re.search(r"(^|[\s;&|(])vllm\s+serve\b", command):
        return [f"server {spec.name!r} runs vllm serve without --served-model-name; the reward asks for model {wanted!r} "
                "(add --served-model-name {served_model_name})"]
    return []


def envname(name: str) -> str:
    """A server's name as the prefix of its shell variables (``general-rm`` -> ``GENERAL_RM``)."""
    return "".join(c if c.isalnum() else "_" for c in str(name)).upper()
