"""An HF ``config.json`` for a NeMo mcore GPT checkpoint that does not pack one (e.g. an Aligner-trained policy).

NeMo's ``save_to`` keeps only ``model_config.yaml``, the weights and registered artifacts, so a
checkpoint written by training has lost the ``hf_config.json`` our converter packed. Everything HF
needs is in the NeMo config; the family follows from ``qkv_bias`` (Qwen2 has QKV biases, Llama not).
"""

from __future__ import annotations

import logging

import torch

from nemo_factuality.convert.hf_config import Rope
from nemo_factuality.convert.torch_dist import TorchDistReader
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)
_PRECISION = {32: "float32", "32": "float32", "bf16": "bfloat16", "bf16-mixed": "bfloat16", 16: "float16",
              "16": "float16", "16-mixed": "float16"}


def _require(cfg: dict, key: str, expected: tuple) -> None:
    value = cfg.get(key)
    if value not in expected:
        raise FactualityInputError(f"model_config.yaml has {key}={value!r}; only {expected} (Llama/Qwen2 style) convert to HF")


def hf_config_from_nemo(cfg: dict, weights: TorchDistReader) -> dict:
    """Llama/Qwen2 ``config.json`` (``*ForSequenceClassification`` when the checkpoint has ``rm_head``)."""
    if not cfg.get("mcore_gpt"):
        raise FactualityInputError("model_config.yaml is not an mcore GPT model (mcore_gpt is not true); legacy NeMo "
                                   "checkpoints need NeMo's convert_gpt_nemo_to_mcore.py first")
    _require(cfg, "activation", ("fast-swiglu", "swiglu"))
    _require(cfg, "normalization", ("rmsnorm", "RMSNorm"))
    _require(cfg, "position_embedding_type", ("rope",))
    embed = weights.shape("model.embedding.word_embeddings.weight")
    heads = cfg["num_attention_heads"]
    vocab = cfg.get("override_vocab_size")
    if vocab is None:
        vocab = embed[0]
        log.warning("model_config.yaml has no override_vocab_size: using the (possibly padded) embedding rows %d as "
                    "vocab_size; pass --hf-config with the original config.json to strip the padding", vocab)
    reward = "model.rm_head.weight" in weights.tensors
    family = "qwen2" if cfg.get("qkv_bias") else "llama"
    dtype = weights.dtype("model.embedding.word_embeddings.weight")
    config = {
        "architectures": [f"{'Qwen2' if family == 'qwen2' else 'Llama'}{'ForSequenceClassification' if reward else 'ForCausalLM'}"],
        "model_type": family, "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["ffn_hidden_size"],
        "num_hidden_layers": cfg["num_layers"], "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_query_groups") or heads,
        "head_dim": cfg.get("kv_channels") or cfg["hidden_size"] // heads,
        "vocab_size": vocab, "max_position_embeddings": cfg.get("max_position_embeddings", cfg.get("encoder_seq_length")),
        "rms_norm_eps": cfg.get("layernorm_epsilon", 1e-5), "rope_theta": float(cfg.get("rotary_base", 10000.0)),
        "tie_word_embeddings": bool(cfg.get("share_embeddings_and_output_weights", False)),
        "hidden_act": "silu", "attention_bias": bool(cfg.get("qkv_bias")), "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch.") if dtype in (torch.float32, torch.bfloat16, torch.float16)
        else _PRECISION.get(cfg.get("precision"), "float32"),
    }
    if cfg.get("scale_positional_embedding"):  # NeMo's Llama-3 frequency scaling (factor 8 unless the config says)
        factor = float(cfg.get("rope_scaling_factor") or cfg.get("seq_len_interpolation_factor") or 8.0)
        config["rope_scaling"] = Rope(config["rope_theta"], "llama3", factor).scaling_fields()
    elif cfg.get("seq_len_interpolation_factor"):
        config["rope_scaling"] = Rope(config["rope_theta"], "linear", float(cfg["seq_len_interpolation_factor"])).scaling_fields()
    if reward:
        config["num_labels"] = 1
    return config
