"""The megatron presets' memory arithmetic checked against what does not come from it (issue 39, item 8).

``test_megatron_presets.py`` checks that the presets' comments and the docs table are what
``backends.megatron.memory`` computes; this module checks ``backends.megatron.memory``'s inputs and terms against
independent sources:

* the parameter count: the real transformers model of each preset's architecture, built on the meta device (no
  memory), counted parameter by parameter — and the model cards' published sizes;
* the engine's KV cache per token: read off that model's attention projections (``k_proj``/``v_proj`` output
  widths), not from the ``2·L·kv·d`` formula;
* the training step's resident states: bytes per parameter (bf16 weight, fp32 gradient, Adam's fp32 main weight and
  two moments) times the counted parameters, split over TP×PP and, for Adam, DP.

Each check is shown to catch a wrong or missing term (the negative controls at the end).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import yaml

from nemo_factuality.config import REPO_ROOT
from nemo_factuality.trainers.backends.megatron.memory import Engine, engine_bytes, plan
from nemo_factuality.trainers.backends.memory import Arch, parameter_states

PRESETS = sorted((REPO_ROOT / "conf" / "train" / "megatron").glob("*.yaml"))
#: the model cards' "Number of Parameters" (Qwen2.5 7B/14B/32B; the R1 distills keep their base model's shape)
PUBLISHED = {"7b": 7.61e9, "14b": 14.7e9, "32b": 32.5e9}
PRESET_SIZE = {"7b": 28, "14b": 48, "32b": 64}  # layers of each size


def _hf_model(arch: dict) -> torch.nn.Module:
    return _hf_model_of(tuple(sorted(arch.items())))


@functools.cache
def _hf_model_of(items: tuple) -> torch.nn.Module:
    """One model per architecture (the R1 distills share Qwen2.5's), built once for the module."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    arch = dict(items)
    cfg = Qwen2Config(hidden_size=arch["hidden"], num_hidden_layers=arch["layers"], num_attention_heads=arch["heads"],
                      num_key_value_heads=arch["kv_heads"], intermediate_size=arch["ffn"], vocab_size=arch["vocab"],
                      tie_word_embeddings=arch.get("tied", False))
    with torch.device("meta"):
        return Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module", params=PRESETS, ids=lambda p: p.stem)
def preset(request) -> tuple[dict, torch.nn.Module]:
    data = yaml.safe_load(request.param.read_text())
    return data, _hf_model(data["arch"])


def _counted(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_the_parameter_count_is_the_real_models(preset):
    data, model = preset
    counted = _counted(model)
    assert Arch(**data["arch"]).parameters() == counted
    size = next(k for k in PUBLISHED if PRESET_SIZE[k] == data["arch"]["layers"])
    # the cards round loosely (Qwen2.5-32B's "32.5B" is 32.76B in its checkpoint); a missing output layer is 2.4%
    assert abs(counted - PUBLISHED[size]) / PUBLISHED[size] < 0.01, (size, counted)


def _kv_bytes_per_token(model: torch.nn.Module, tp: int, bytes_per_value: int = 2) -> int:
    """K and V for one token on one engine GPU, from the model's own projections (heads split over TP, whole)."""
    total = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        kv_heads = attn.k_proj.out_features // attn.head_dim
        total += 2 * math.ceil(kv_heads / tp) * attn.head_dim * bytes_per_value
    return total


def test_the_engines_kv_cache_holds_what_the_models_projections_need(preset):
    data, model = preset
    arch = Arch(**data["arch"])
    for method in ("grpo", "kto"):
        engine = plan(data, method).engine
        if engine is None:
            continue
        got = engine_bytes(arch, engine)
        want = math.floor(got["kv_cache"] / (_kv_bytes_per_token(model, engine.tp) * engine.seq_len))
        assert got["sequences"] == want, (method, got["sequences"], want)


def test_the_resident_states_are_bytes_per_parameter_times_the_real_count(preset):
    data, model = preset
    p, lay = _counted(model), plan(data, "grpo").layout
    got = parameter_states(Arch(**data["arch"]).parameters(), lay)
    m = lay.tp * lay.pp
    assert got["weights"] == 2 * p / m  # bf16
    assert got["grads"] == 4 * p / m  # fp32 gradient buffer (grad_reduce_in_fp32)
    assert got["optimizer"] == (4 + 4 + 4) * p / m / (lay.dp if lay.distributed_optimizer else 1)  # main, m, v


def test_the_checks_catch_a_wrong_term():
    """Negative controls: the count with the Q/K/V biases left out, or the output layer tied, is not the real model's;
    a KV term that forgets to split the heads over the engine's TP is not the projections' either."""
    arch = {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "ffn": 18944, "vocab": 152064, "tied": False}
    model = _hf_model(arch)
    counted = _counted(model)
    assert Arch(**arch, qkv_bias=False).parameters() != counted
    assert Arch(**{**arch, "tied": True}).parameters() != counted
    unsplit = 2 * arch["layers"] * arch["kv_heads"] * (arch["hidden"] // arch["heads"]) * 2
    assert _kv_bytes_per_token(model, tp=2) != unsplit and _kv_bytes_per_token(model, tp=1) == unsplit
    wrong = Engine(tp=2, gpu_memory_utilization=0.5, placement="separate", seq_len=4096)
    kv = engine_bytes(Arch(**arch), wrong)["kv_cache"]
    assert math.floor(kv / (unsplit * 4096)) != engine_bytes(Arch(**arch), wrong)["sequences"]
