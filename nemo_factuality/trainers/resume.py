"""What a rerun into a run folder may resume, decided from files before anything loads or is written.

A stage resumes the folder's latest checkpoint (``exp_manager.resume_if_exists``). A checkpoint records the model it was
trained from (``model_identity``: the backend and the architecture its weights have); a rerun whose ``model.path`` (or
``model.restore_from_path``) describes another one is refused in one line here, before the backend builds anything —
before, the load failed after minutes with a 55-line ``size mismatch for lm_head.weight`` traceback, and the first run's
``config.yaml`` had already been overwritten. A resume keeps the first run's ``config.yaml`` and writes the settings it
changed beside it (``config.resume.<step>.yaml``), saying so in one log line: a changed learning rate is taken, but
never silently.

Only files are read (``config.json`` / ``model_config.yaml``, the checkpoint's ``trainer_state.json``): no torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

# what makes two checkpoints' weights the same shapes: an HF config's keys, NeMo's model_config.yaml's
_HF_KEYS = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "head_dim", "tie_word_embeddings")
_NEMO_KEYS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
              "share_embeddings_and_output_weights")


def model_identity(cfg: Any) -> dict[str, Any]:
    """The backend and the architecture of the model the stage trains (its ``model.path`` / ``model.restore_from_path``),
    as checkpoints record it; keys the model's files lack are left out."""
    model = cfg.model
    source = getattr(model, "path", None) or getattr(model, "restore_from_path", None)
    return {"backend": cfg.trainer.backend, "architecture": _architecture(Path(source)) if source else {}}


def _architecture(path: Path) -> dict[str, Any]:
    if (path / "config.json").is_file():
        found = json.loads((path / "config.json").read_text(encoding="utf-8"))
        keys = _HF_KEYS
    elif (path / "model_config.yaml").is_file():  # an extracted .nemo
        import yaml

        found = yaml.safe_load((path / "model_config.yaml").read_text(encoding="utf-8")) or {}
        keys = _NEMO_KEYS
    else:  # a .nemo archive: its config is inside the tar; the backend's own load checks it
        return {}
    return {k: found[k] for k in keys if k in found}


def latest_state(run_dir: Path) -> tuple[str, dict[str, Any]] | None:
    """(the step folder ``checkpoints/latest`` names, its ``trainer_state.json``), read only; None without one (an
    incomplete one is the checkpointer's to report)."""
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    for candidate in (root / name, root / f".{name}.replaced"):  # killed mid re-save: the old one stands
        state = candidate / "trainer_state.json"
        if state.is_file():
            return name, json.loads(state.read_text(encoding="utf-8"))
    return None


def check_resume(run_dir: Path, cfg: Any) -> str | None:
    """The checkpoint this run will resume (its step folder's name), or None; a checkpoint of another model or backend
    is one ``FactualityInputError`` naming what differs and what to pass."""
    if not cfg.exp_manager.resume_if_exists:
        return None
    found = latest_state(run_dir)
    if found is None:
        return None
    name, state = found
    recorded, current = state.get("model"), model_identity(cfg)
    if not recorded:  # a checkpoint written before identities were recorded: the backend's own load decides
        return name
    differences = _differences(recorded, current)
    if differences:
        raise FactualityInputError(
            f"exp_manager.explicit_log_dir={run_dir}: its checkpoint {name} was trained from another model "
            f"({'; '.join(differences)}): point exp_manager.explicit_log_dir at a new folder, or set "
            "exp_manager.resume_if_exists=false to start this model there from its first step")
    return name


def _differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    out = []
    if recorded.get("backend") != current.get("backend"):
        out.append(f"trainer.backend={recorded.get('backend')} there, {current.get('backend')} now")
    was, now = recorded.get("architecture") or {}, current.get("architecture") or {}
    out += [f"{k} {was[k]} there, {now[k]} now" for k in sorted(set(was) & set(now)) if was[k] != now[k]]
    return out


def write_run_config(run_dir: Path, config_yaml: str, resumed: str | None) -> Path | None:
    """``config.yaml`` for a new run; on a resume the first run's stays, and the settings this run changed go to
    ``config.resume.<step>.yaml`` (returned; None when nothing changed or the run is new)."""
    import yaml

    first = run_dir / "config.yaml"
    if resumed is None or not first.is_file():
        first.write_text(config_yaml, encoding="utf-8")
        return None
    changed = _changed(_flat(yaml.safe_load(first.read_text(encoding="utf-8")) or {}), _flat(yaml.safe_load(config_yaml)))
    if not changed:
        return None
    path = run_dir / f"config.resume.{resumed}.yaml"
    path.write_text(yaml.safe_dump({"resumed_from": resumed, "changed": changed}, sort_keys=True), encoding="utf-8")
    log.warning("resuming %s with %d changed setting(s): %s (the first run's config.yaml is kept; the changes are in %s)",
                resumed, len(changed), ", ".join(f"{k} {v['first']!r} → {v['now']!r}" for k, v in changed.items()),
                path)
    return path


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _changed(first: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: {"first": first.get(k), "now": now.get(k)} for k in sorted(set(first) | set(now))
            if first.get(k) != now.get(k)}
