"""Model presets (``conf/train/<backend>/<name>.yaml``): a model's layout, batch sizes and settings per method on
8×H100-80GB nodes, with their per-GPU memory arithmetic beside them, for the backends that train at that scale —
``aligner`` (a ``.nemo`` policy; ``backends/aligner/actor.py`` also hands NeMo the settings the stage schema lacks) and
``megatron`` (an HF policy; every setting is a stage key). ``--preset NAME`` looks in the folder of the stage's
``trainer.backend``: the same model has a preset per backend, so the backend chooses which.

A preset file: ``common:`` (stage overrides for every method) and one section per method (``grpo``, ``ppo``,
``kto``) whose ``overrides:`` go on top; the command line's overrides go on top of both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nemo_factuality.config import ConfigError, dotlist
from nemo_factuality.config import merge_tree as merge

PRESET_BACKENDS = ("aligner", "megatron")  # the backends with a conf/train/<backend>/ folder of presets


def preset_dir(backend: str) -> Path:
    from nemo_factuality.config import conf_dir

    return conf_dir() / "train" / backend


def read_preset(backend: str, name: str) -> dict[str, Any]:
    """The preset file as a mapping; ``ConfigError`` naming what exists when there is no such preset."""
    import yaml

    path = preset_dir(backend) / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in preset_dir(backend).glob("*.yaml"))
        raise ConfigError(f"--preset {name}: no {backend} preset {path}; known: {', '.join(known) or '(none)'}")
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def megatron_overrides(name: str, method: str) -> list[str]:
    """A megatron preset's stage overrides for ``method`` (grpo | ppo | kto): ``common`` then the method's own."""
    preset = read_preset("megatron", name)
    if method not in preset:
        raise ConfigError(f"--preset {name}: conf/train/megatron/{name}.yaml has no {method!r} section (grpo | ppo | kto)")
    return dotlist(merge(preset["common"], preset[method]["overrides"]))


def load_preset(backend: str, name: str, method: str) -> tuple[list[str], dict[str, Any]]:
    """(stage ``key=value`` overrides, the backend builder's runtime fields) of preset ``name`` for ``method`` on
    ``backend``; one ``ConfigError`` line when that backend has no such preset (naming the backends that do)."""
    if backend not in PRESET_BACKENDS:
        have = [b for b in PRESET_BACKENDS if (preset_dir(b) / f"{name}.yaml").is_file()]
        where = " and ".join(f"conf/train/{b}/{name}.yaml is a{'n' if b[0] in 'aeiou' else ''} {b}-backend preset"
                             for b in have) or f"no backend has a preset {name!r}"
        raise ConfigError(f"--preset {name}: trainer.backend={backend} has no presets; {where}: "
                          f"add {' or '.join(f'trainer.backend={b}' for b in have or PRESET_BACKENDS)}")
    if backend == "aligner":
        from nemo_factuality.trainers.backends.aligner.actor import load_preset as load_aligner_preset

        try:
            return load_aligner_preset(name, method)
        except (FileNotFoundError, KeyError) as err:
            raise ConfigError(f"--preset {name}: {err}") from err
    return megatron_overrides(name, method), {}
