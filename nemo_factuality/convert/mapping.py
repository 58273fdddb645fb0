"""HF (Llama / Qwen2) ↔ Megatron-Core GPT weight mapping as tables plus three documented transforms.

Key names follow the Megatron-Core *local* layer spec (what the CPU verifier builds); NeMo's
checkpoints use the Transformer Engine spec, where the two layer norms live inside the fused
linears — ``TE_NAMES`` renames them. Every tensor's shape is asserted against the model spec.

Transforms (why they exist):
* **QKV**: Megatron fuses Q, K, V into one ``linear_qkv`` whose rows are grouped per KV head:
  ``[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...]`` (GQA). Biases (Qwen2) likewise.
* **fc1**: SwiGLU's gate and up projections are stacked ``[gate; up]`` in ``linear_fc1``.
* **vocab padding**: Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by``
  (× TP); padded rows are zeros and are stripped on the way back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from nemo_factuality.convert.hf_config import Rope, read_rope
from nemo_factuality.types import FactualityInputError

SUPPORTED_FAMILIES = ("llama", "qwen2")
Getter = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    family: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    padded_vocab: int
    qkv_bias: bool
    tied: bool
    rope: Rope
    rms_eps: float
    max_positions: int
    reward_head: bool = False  # LlamaForSequenceClassification-style scalar head
    divisor: int = 128  # make_vocab_size_divisible_by


def padded_vocab_size(vocab: int, divisible_by: int, tp: int = 1) -> int:
    multiple = divisible_by * tp
    return ((vocab + multiple - 1) // multiple) * multiple


def default_divisor(vocab: int) -> int:
    """NeMo's converters: the largest power of two <= 128 that divides the vocabulary (no padding needed)."""
    d = 128
    while vocab % d:
        d //= 2
    return d


def spec_from_hf_config(cfg: dict, make_vocab_size_divisible_by: int | None = None, tp: int = 1) -> ModelSpec:
    """Model dimensions from an HF ``config.json`` dict (either transformers layout); unsupported families
    and RoPE variants fail clearly (``hf_config.read_rope``).

    ``make_vocab_size_divisible_by=None`` uses NeMo's rule (see ``default_divisor``), so nothing is padded.
    """
    family = cfg.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise FactualityInputError(f"unsupported model_type {family!r}: the converters handle {SUPPORTED_FAMILIES} "
                                   "(Llama-3.x and Qwen2/Qwen2.5, incl. DeepSeek-R1-Distill-Qwen)")
    missing = [k for k in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
               if not isinstance(cfg.get(k), int)]
    if missing:
        raise FactualityInputError(f"config.json lacks integer fields {missing}: not a complete {family} config")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    archs = cfg.get("architectures") or []
    return ModelSpec(
        family=family, num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], ffn=cfg["intermediate_size"],
        heads=heads, kv_heads=cfg.get("num_key_value_heads", heads), head_dim=head_dim, vocab=cfg["vocab_size"],
        padded_vocab=padded_vocab_size(cfg["vocab_size"], make_vocab_size_divisible_by or default_divisor(cfg["vocab_size"]), tp),
        divisor=make_vocab_size_divisible_by or default_divisor(cfg["vocab_size"]),
        qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias")), tied=bool(cfg.get("tie_word_embeddings")),
        rope=read_rope(cfg), rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_positions=cfg.get("max_position_embeddings", 4096),
        reward_head=any(a.endswith("ForSequenceClassification") for a in archs),
    )


# HF → Megatron-Core (local spec) per-layer table; "{}" is the layer index.
LAYER_COPY = {
    "model.layers.{}.self_attn.o_proj.weight": "decoder.layers.{}.self_attention.linear_proj.weight",
    "model.layers.{}.mlp.down_proj.weight": "decoder.layers.{}.mlp.linear_fc2.weight",
    "model.layers.{}.input_layernorm.weight": "decoder.layers.{}.input_layernorm.weight",
    "model.layers.{}.post_attention_layernorm.weight": "decoder.layers.{}.pre_mlp_layernorm.weight",
}
GLOBAL_COPY = {"model.norm.weight": "decoder.final_layernorm.weight"}
TE_NAMES = {  # local spec → Transformer Engine spec (what NeMo checkpoints use)
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def to_te_name(key: str) -> str:
    for local, te in TE_NAMES.items():
        if key.endswith(local):
            return key[: -len(local)] + te
    return key


def from_te_name(key: str) -> str:
    for local, te in TE_NAMES.items():
        if key.endswith(te):
            return key[: -len(te)] + local
    return key


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    assert tuple(t.shape) == shape, f"{name}: shape {tuple(t.shape)}, expected {shape}"
    return t


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelSpec) -> torch.Tensor:
    """[heads·d, …], [kv·d, …], [kv·d, …] → grouped ``[kv·(heads/kv + 2)·d, …]`` (works for weights and biases)."""
    per_group = s.heads // s.kv_heads
    tail = q.shape[1:]
    q = q.reshape(s.kv_heads, per_group * s.head_dim, *tail)
    k = k.reshape(s.kv_heads, s.head_dim, *tail)
    v = v.reshape(s.kv_heads, s.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(s.kv_heads * (per_group + 2) * s.head_dim, *tail).contiguous()


def split_qkv(qkv: torch.Tensor, s: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    per_group = s.heads // s.kv_heads
    tail = qkv.shape[1:]
    g = qkv.reshape(s.kv_heads, (per_group + 2) * s.head_dim, *tail)
    q, k, v = torch.split(g, [per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return (q.reshape(s.heads * s.head_dim, *tail).contiguous(), k.reshape(s.kv_heads * s.head_dim, *tail).contiguous(),
            v.reshape(s.kv_heads * s.head_dim, *tail).contiguous())


def _pad_vocab(t: torch.Tensor, s: ModelSpec) -> torch.Tensor:
    if s.padded_vocab == t.shape[0]:
        return t
    return torch.cat([t, t.new_zeros(s.padded_vocab - t.shape[0], *t.shape[1:])], dim=0)


def _embedding_to_mcore(get: Getter, s: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    yield "embedding.word_embeddings.weight", _pad_vocab(_check("embed_tokens", get("model.embed_tokens.weight"), (s.vocab, s.hidden)), s)


def _layer_to_mcore(get: Getter, s: ModelSpec, i: int) -> Iterator[tuple[str, torch.Tensor]]:
    h, d = s.hidden, s.head_dim
    p = f"model.layers.{i}.self_attn."
    q, k, v = (get(p + f"{n}_proj.weight") for n in "qkv")
    _check(p + "q_proj.weight", q, (s.heads * d, h))
    _check(p + "k_proj.weight", k, (s.kv_heads * d, h))
    _check(p + "v_proj.weight", v, (s.kv_heads * d, h))
    yield f"decoder.layers.{i}.self_attention.linear_qkv.weight", _check("linear_qkv", fuse_qkv(q, k, v, s), ((s.heads + 2 * s.kv_heads) * d, h))
    del q, k, v
    if s.qkv_bias:
        yield f"decoder.layers.{i}.self_attention.linear_qkv.bias", fuse_qkv(*(get(p + f"{n}_proj.bias") for n in "qkv"), s)
    gate, up = get(f"model.layers.{i}.mlp.gate_proj.weight"), get(f"model.layers.{i}.mlp.up_proj.weight")
    _check("gate_proj", gate, (s.ffn, h))
    _check("up_proj", up, (s.ffn, h))
    fc1 = torch.cat([gate, up], dim=0)
    del gate, up
    yield f"decoder.layers.{i}.mlp.linear_fc1.weight", fc1
    for hf_key, mc_key in LAYER_COPY.items():
        yield mc_key.format(i), get(hf_key.format(i))


def _head_to_mcore(get: Getter, s: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    for hf_key, mc_key in GLOBAL_COPY.items():
        yield mc_key, _check(hf_key, get(hf_key), (s.hidden,))
    if s.reward_head:
        score = _check("score.weight", get("score.weight"), (1, s.hidden))
        yield "rm_head.weight", score
        # NeMo-Aligner's RewardModelHead is a RowParallelLinear with a bias; HF's score has none
        yield "rm_head.bias", score.new_zeros(1)
        # Aligner's reward model is an untied GPTModel: it never uses its LM head but loads one. HF RMs have
        # none, so the head is the (tied) embedding: harmless for rewards, meaningful if reused as an LM head.
        yield "output_layer.weight", _pad_vocab(get("model.embed_tokens.weight"), s)
    elif not s.tied:
        yield "output_layer.weight", _pad_vocab(_check("lm_head", get("lm_head.weight"), (s.vocab, s.hidden)), s)


def hf_to_mcore_groups(get: Getter, s: ModelSpec) -> list[tuple[str, Callable[[], Iterator[tuple[str, torch.Tensor]]]]]:
    """The conversion as named groups (``embedding``, ``layer.<i>``, ``head``), each a lazy tensor stream.

    A group is the unit a streaming writer stores and resumes; nothing is read until a group is iterated.
    """
    groups = [("embedding", partial(_embedding_to_mcore, get, s))]
    groups += [(f"layer.{i}", partial(_layer_to_mcore, get, s, i)) for i in range(s.num_layers)]
    return groups + [("head", partial(_head_to_mcore, get, s))]


def hf_to_mcore(get: Getter, s: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield Megatron-Core (local spec) tensors one at a time; ``get(hf_key)`` reads one HF tensor."""
    for _, produce in hf_to_mcore_groups(get, s):
        yield from produce()


def mcore_to_hf(get: Callable[[str], torch.Tensor], s: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of ``hf_to_mcore`` (vocab padding stripped, QKV and fc1 split)."""
    yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")[: s.vocab].contiguous()
    for i in range(s.num_layers):
        p = f"model.layers.{i}.self_attn."
        for name, t in zip("qkv", split_qkv(get(f"decoder.layers.{i}.self_attention.linear_qkv.weight"), s)):
            yield p + f"{name}_proj.weight", t
        if s.qkv_bias:
            for name, t in zip("qkv", split_qkv(get(f"decoder.layers.{i}.self_attention.linear_qkv.bias"), s)):
                yield p + f"{name}_proj.bias", t
        gate, up = torch.split(get(f"decoder.layers.{i}.mlp.linear_fc1.weight"), [s.ffn, s.ffn], dim=0)
        yield f"model.layers.{i}.mlp.gate_proj.weight", gate.contiguous()
        yield f"model.layers.{i}.mlp.up_proj.weight", up.contiguous()
        for hf_key, mc_key in LAYER_COPY.items():
            yield hf_key.format(i), get(mc_key.format(i))
    for hf_key, mc_key in GLOBAL_COPY.items():
        yield hf_key, get(mc_key)
    if s.reward_head:
        yield "score.weight", get("rm_head.weight")
    elif not s.tied:
        yield "lm_head.weight", get("output_layer.weight")[: s.vocab].contiguous()
