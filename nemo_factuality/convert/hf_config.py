"""HF ``config.json`` layouts: read both, refuse what the converters do not understand, write the installed one.

transformers <= 4.x writes ``rope_theta`` and ``rope_scaling`` at the top level and ``torch_dtype``;
transformers 5 writes them inside ``rope_parameters`` (``{"rope_type", "rope_theta", "factor", ...}``)
and ``dtype``. A converter that reads only one layout silently falls back to ``rope_theta = 10000`` and
no scaling on the other, which changes every logit; so both are read, a disagreement between them is
an error, and RoPE variants Megatron-Core's GPT model cannot express are refused by name.

Supported RoPE: ``default``; ``linear`` (NeMo ``seq_len_interpolation_factor``); ``llama3`` with
Llama-3.x's fixed ``low_freq_factor=1``, ``high_freq_factor=4``, ``original_max_position_embeddings=8192``
(Megatron-Core and NeMo hard-code them; only ``factor`` is a parameter).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from nemo_factuality.types import FactualityInputError

DEFAULT_ROPE_THETA = 10000.0  # the HF Llama/Qwen2 default when a config names no theta
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


@dataclass(frozen=True)
class Rope:
    """The rotary embedding of a model: ``kind`` in SUPPORTED_ROPE_TYPES, ``factor`` None for ``default``."""

    theta: float
    kind: str = "default"
    factor: float | None = None

    def scaling_fields(self) -> dict[str, Any]:
        """HF's scaling keys (no theta): ``{}`` for default RoPE."""
        if self.kind == "default":
            return {}
        return {"rope_type": self.kind, "factor": self.factor, **(LLAMA3_FIXED if self.kind == "llama3" else {})}


def _same(a: float, b: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-9)


def _scaling_of(params: dict[str, Any] | None, where: str) -> tuple[str, dict[str, Any]]:
    if not params:
        return "default", {}
    if not isinstance(params, dict):
        raise FactualityInputError(f"config.json {where} must be an object, got {params!r}")
    kind = params.get("rope_type", params.get("type", "default"))
    return ("default" if kind is None else str(kind)), params


def read_rope(cfg: dict[str, Any]) -> Rope:
    """The RoPE of an HF config in either layout; unknown or contradictory settings raise ``FactualityInputError``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise FactualityInputError(f"config.json has per-layer-type rope_parameters ({sorted(params)}): "
                                   "the converters handle one RoPE for every layer (Llama/Qwen2)")
    thetas = {k: v for k, v in (("rope_theta", cfg.get("rope_theta")),
                                ("rope_parameters.rope_theta", (params or {}).get("rope_theta"))) if v is not None}
    if len(thetas) == 2 and not _same(*thetas.values()):
        raise FactualityInputError(f"config.json disagrees with itself: {thetas}; keep one of them")
    theta = float(next(iter(thetas.values()), DEFAULT_ROPE_THETA))
    kinds = [_scaling_of(cfg.get("rope_scaling"), "rope_scaling"), _scaling_of(params, "rope_parameters")]
    scaled = [(k, p) for k, p in kinds if k != "default"]
    if len(scaled) == 2 and (scaled[0][0] != scaled[1][0] or not _same(scaled[0][1].get("factor", 0),
                                                                      scaled[1][1].get("factor", 0))):
        raise FactualityInputError(f"config.json has two different RoPE scalings: rope_scaling={cfg.get('rope_scaling')} "
                                   f"and rope_parameters={params}; keep one of them")
    partial = cfg.get("partial_rotary_factor", (params or {}).get("partial_rotary_factor"))
    if partial is not None and not _same(partial, 1.0):
        raise FactualityInputError(f"config.json has partial_rotary_factor={partial}: the converters handle full "
                                   "rotary embeddings only")
    if cfg.get("use_sliding_window"):
        raise FactualityInputError("config.json has use_sliding_window=true: Megatron-Core's GPT model here has no "
                                   "sliding-window attention; set it to false only if the model was trained without it")
    if not scaled:
        return Rope(theta)
    kind, fields = scaled[0]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise FactualityInputError(f"config.json asks for RoPE type {kind!r}: the converters handle {SUPPORTED_ROPE_TYPES} "
                                   "(what Megatron-Core's GPT model implements); refusing instead of converting it "
                                   "as plain RoPE")
    if not isinstance(fields.get("factor"), (int, float)) or fields["factor"] <= 0:
        raise FactualityInputError(f"config.json RoPE scaling {kind!r} needs a positive 'factor', got {fields.get('factor')!r}")
    if kind == "llama3":
        odd = {k: fields.get(k) for k, v in LLAMA3_FIXED.items() if fields.get(k) is None or not _same(fields[k], v)}
        if odd:
            raise FactualityInputError(f"config.json llama3 RoPE scaling has {odd}; Megatron-Core and NeMo implement "
                                       f"only {LLAMA3_FIXED} (Llama-3.1/3.2/3.3)")
    return Rope(theta, kind, float(fields["factor"]))


@functools.lru_cache(maxsize=1)
def installed_layout() -> str:
    """``"rope_parameters"`` (transformers >= 5) or ``"top_level"``: what the installed transformers writes."""
    from transformers import LlamaConfig

    return "rope_parameters" if "rope_parameters" in LlamaConfig().to_dict() else "top_level"


def to_installed_layout(cfg: dict[str, Any], dtype: str | None = None) -> dict[str, Any]:
    """``cfg`` with RoPE and dtype keys in the layout the installed transformers writes (validated on the way).

    ``dtype``: the weights' dtype name (replaces ``dtype`` / ``torch_dtype``); None keeps the config's own.
    """
    rope = read_rope(cfg)
    out = {k: v for k, v in cfg.items() if k not in _ROPE_KEYS + ("dtype", "torch_dtype")}
    if installed_layout() == "rope_parameters":
        out["rope_parameters"] = {"rope_type": rope.kind, "rope_theta": rope.theta, **rope.scaling_fields()}
    else:
        out["rope_theta"] = rope.theta
        if rope.kind != "default":
            out["rope_scaling"] = rope.scaling_fields()
    dtype = dtype or cfg.get("dtype") or cfg.get("torch_dtype")
    if dtype is not None:
        out["dtype" if installed_layout() == "rope_parameters" else "torch_dtype"] = dtype
    return out
