"""Local Hugging Face directories (a policy, a critic, a tokenizer, a reward or NLI model): checked before any
work, loaded without the Hub.

Offline is the default: every model path of this toolkit is a directory on this machine (``save_pretrained``
output); nothing is downloaded at run time. transformers reads a path that does not exist as a Hub repo id
(``outputs/nosuch`` → a minute of Hub retries, then a traceback; ``/models/nosuch`` → "Repo id must be in the
form…"), so each path is checked here first: one that does not exist, a file, a directory without
``config.json`` (or without tokenizer files), a ``config.json`` that is not a JSON object, or a safetensors
shard that is truncated or corrupt (the converter's own header check, ``convert.safetensors_io.read_header``)
is one ``FactualityInputError`` naming the setting and the path. ``from_pretrained`` then runs with
``local_files_only=True``, and whatever it still refuses is one line too.

This is the one boundary for model paths: the training stages (``model.path``, ``critic.path``), ``serve``
(``policy_tokenizer``), the converter (``--hf``) and the rewards' local models go through it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nemo_factuality.types import FactualityInputError

TOKENIZER_MAIN_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of these makes a usable tokenizer
_TORCH_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")  # transformers loads these too (not converted)


def _setting(key: str, path: str | Path) -> str:
    """How the message names the value: ``model.path=DIR`` for a config key, ``--hf DIR`` for a flag."""
    return f"{key} {path}" if key.startswith("-") else f"{key}={path}"


def read_json_object(path: Path) -> dict:
    """A JSON object from ``path``; invalid UTF-8/JSON or another type raises ``FactualityInputError`` naming it."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise FactualityInputError(f"{path}: invalid UTF-8 at byte {err.start}") from None
    except json.JSONDecodeError as err:
        raise FactualityInputError(f"{path}:{err.lineno}:{err.colno}: invalid JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise FactualityInputError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def local_dir(path: str | Path, key: str, what: str = "model") -> Path:
    """``path`` as an existing local directory, else one line naming ``key`` (never read as a Hub repo id)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FactualityInputError(f"{_setting(key, path)}: no such directory; pass a local Hugging Face {what} "
                                   "directory (save_pretrained output): nothing is downloaded")
    if not p.is_dir():
        raise FactualityInputError(f"{_setting(key, path)} is a file, not a {what} directory: pass the directory "
                                   "save_pretrained wrote (config.json, model.safetensors, tokenizer files)")
    return p


def safetensors_shards(path: Path) -> tuple[list[str], dict[str, str] | None]:
    """(shard file names, the index's ``weight_map`` or None) of an HF directory; ``[]`` when it has no safetensors.
    A shard the index lists but the directory lacks is an error."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        return [], None
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise FactualityInputError(f"{path}: shards listed in the index are missing: {missing[:3]}")
    return files, weight_map


def open_safetensors(path: Path) -> Any:
    """A ``SafetensorsReader`` over the directory's shards, every header checked (a truncated or corrupt shard is
    named) and the index checked against the shards; None when the directory has no safetensors."""
    from nemo_factuality.convert.safetensors_io import SafetensorsReader

    files, weight_map = safetensors_shards(path)
    if not files:
        return None
    reader = SafetensorsReader(path / f for f in files)
    if weight_map is not None and set(weight_map) - set(reader.keys()):
        reader.close()
        raise FactualityInputError(f"{path}: the index lists tensors no shard holds: "
                                   f"{sorted(set(weight_map) - set(reader.keys()))[:3]}")
    return reader


def check_model_dir(path: str | Path, key: str, *, tokenizer: bool = False) -> Path:
    """A local HF model directory that will load: ``config.json`` a JSON object, its weights present and (for
    safetensors) whole; with ``tokenizer``, its tokenizer files too. Reads only headers: cheap on any size."""
    p = local_dir(path, key)
    if not (p / "config.json").is_file():
        raise FactualityInputError(f"{_setting(key, path)} has no config.json: pass a Hugging Face model directory "
                                   "(save_pretrained output)")
    read_json_object(p / "config.json")
    reader = open_safetensors(p)
    if reader is not None:
        reader.close()
    elif not any((p / f).is_file() for f in _TORCH_WEIGHTS):
        raise FactualityInputError(f"{_setting(key, path)} has no model weights (model.safetensors, or its "
                                   "index and shards): re-save the model with save_pretrained")
    if tokenizer:
        check_tokenizer_dir(p, key)
    return p


def check_tokenizer_dir(path: str | Path, key: str) -> Path:
    """A local directory holding a tokenizer (``tokenizer.json``, ``tokenizer.model`` or ``vocab.json``)."""
    p = local_dir(path, key, "tokenizer")
    if not any((p / f).is_file() for f in TOKENIZER_MAIN_FILES):
        raise FactualityInputError(f"{_setting(key, path)} has no tokenizer files ({' / '.join(TOKENIZER_MAIN_FILES)}): "
                                   "save the tokenizer next to the model (tokenizer.save_pretrained)")
    return p


def _load_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, ValueError]
    try:
        from safetensors import SafetensorError

        errors.append(SafetensorError)
    except ImportError:  # pragma: no cover - safetensors is a core dependency
        pass
    return tuple(errors)


def from_pretrained(loader: Callable[..., Any], path: str | Path, key: str, **kwargs: Any) -> Any:
    """``loader(path, local_files_only=True, **kwargs)`` (e.g. ``AutoTokenizer.from_pretrained``): what transformers
    refuses (an unknown model_type, weights that do not fit the config, a file it cannot parse) is one line."""
    try:
        return loader(str(path), local_files_only=True, **kwargs)
    except _load_errors() as err:
        text = " ".join(str(err).split())
        raise FactualityInputError(f"{_setting(key, path)} does not load ({type(err).__name__}: "
                                   f"{text[:300]}{'…' if len(text) > 300 else ''})") from err


def load_tokenizer(path: str | Path, key: str) -> Any:
    """``AutoTokenizer`` from a local tokenizer directory (checked first; never the Hub)."""
    from transformers import AutoTokenizer

    return from_pretrained(AutoTokenizer.from_pretrained, check_tokenizer_dir(path, key), key)


def dtype_keyword() -> str:
    """The installed transformers' name for a model's dtype in ``from_pretrained`` and configs: ``dtype`` since 4.56
    (where ``torch_dtype`` warns it is deprecated), ``torch_dtype`` before (the aligner stack's 4.48 knows no other)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
