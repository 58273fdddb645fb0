"""How Megatron-Core lays a GPT model's tensors out in a ``torch_dist`` checkpoint, for a given TP.

Per-layer tensors are stacked on a leading layer axis (global shape ``[num_layers, ...]``, one chunk
per layer; PP does not change the layout because layer offsets are global). Under tensor parallelism
each rank owns a slice, stored as its own chunk (what ``sharded_state_dict`` of a TP run produces):

* column-parallel (split rows, axis 0): ``linear_qkv`` weight/bias, vocab-parallel embedding, output layer;
* row-parallel (split columns, axis 1): ``linear_proj``, ``linear_fc2``;
* SwiGLU ``linear_fc1``: the global ``[gate; up]`` is cut into ``2·TP`` row blocks, rank ``r`` owning
  blocks ``r`` (gate) and ``TP + r`` (up) — Megatron's ``apply_swiglu_sharded_factory``;
* NeMo-Aligner's reward head (a row-parallel linear): weight split by columns, bias replicated;
* layer norms: replicated, one chunk.

Chunking only decides which bytes a rank reads; any TP/PP can load any layout (DCP reshards).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nemo_factuality.convert.mapping import ModelSpec, to_te_name
from nemo_factuality.convert.torch_dist import Chunk, StoredObject
from nemo_factuality.types import FactualityInputError

ROW_SPLIT = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "embedding.word_embeddings.weight",
             "output_layer.weight", "mlp.linear_fc1.weight")
COLUMN_SPLIT = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight", "rm_head.weight")
# Modules whose ``_extra_state`` (FP8 metadata; None without FP8) NeMo's models ask for when loading: the
# Transformer Engine spec's five, of which the local spec uses the four linears. Without them Megatron's
# default strictness stops with "Missing key in checkpoint state_dict: ..._extra_state/shard_<layer>_<layers>".
EXTRA_STATE_MODULES = ("self_attention.linear_qkv", "self_attention.core_attention", "self_attention.linear_proj",
                       "mlp.linear_fc1", "mlp.linear_fc2")


def check_parallelism(spec: ModelSpec, tp: int, pp: int) -> None:
    """Refuse layouts Megatron cannot build, with the reason."""
    if tp < 1 or pp < 1:
        raise FactualityInputError(f"tensor/pipeline parallel sizes must be >= 1, got TP={tp} PP={pp}")
    problems = []
    if spec.heads % tp:
        problems.append(f"num_attention_heads={spec.heads} is not divisible by TP={tp}")
    # whole KV heads a rank: NeMo-Aligner's Megatron-Core 0.12 requires it (0.16 also lets TP ranks share one KV
    # head when TP is a multiple of them; this layout does not store that case)
    if spec.kv_heads % tp:
        problems.append(f"num_key_value_heads={spec.kv_heads} is not divisible by TP={tp}")
    if spec.ffn % tp:
        problems.append(f"intermediate_size={spec.ffn} is not divisible by TP={tp}")
    if spec.num_layers % pp:
        problems.append(f"num_hidden_layers={spec.num_layers} is not divisible by PP={pp}")
    if spec.padded_vocab % tp:
        problems.append(f"padded vocabulary {spec.padded_vocab} is not divisible by TP={tp}")
    if problems:
        raise FactualityInputError(f"Megatron-Core cannot split this model at TP={tp} PP={pp}: " + "; ".join(problems))


def split_layer_key(key: str) -> tuple[str, int | None]:
    """``decoder.layers.3.x`` → (``decoder.layers.x``, 3); other keys → (key, None)."""
    parts = key.split(".")
    if len(parts) > 2 and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
        return ".".join(parts[:2] + parts[3:]), int(parts[2])
    return key, None


def checkpoint_name(key: str) -> tuple[str, int | None]:
    """Local-spec mcore key → (torch_dist fqn with NeMo's ``model.`` prefix and TE names, layer index)."""
    base, layer = split_layer_key(key)
    return "model." + to_te_name(base), layer


def _tp_blocks(key: str, tp: int) -> tuple[int, int]:
    """(axis, number of equal blocks) for this tensor under TP."""
    if tp == 1:
        return 0, 1
    if key.endswith("mlp.linear_fc1.weight"):
        return 0, 2 * tp
    if key.endswith(ROW_SPLIT):
        return 0, tp
    if key.endswith(COLUMN_SPLIT):
        return 1, tp
    return 0, 1


def chunks_for(key: str, tensor: torch.Tensor, spec: ModelSpec, tp: int) -> Iterator[Chunk]:
    """The chunks a TP=``tp`` Megatron run would store for the local-spec tensor ``key``."""
    fqn, layer = checkpoint_name(key)
    axis, blocks = _tp_blocks(key, tp)
    if tensor.shape[axis] % blocks:
        raise FactualityInputError(f"{key}: size {tensor.shape[axis]} on axis {axis} is not divisible into {blocks} TP blocks")
    step = tensor.shape[axis] // blocks
    for b in range(blocks):
        piece = tensor.narrow(axis, b * step, step)
        offsets = [0] * tensor.dim()
        offsets[axis] = b * step
        if layer is None:
            yield Chunk(fqn, tuple(tensor.shape), tuple(offsets), piece)
        else:
            yield Chunk(fqn, (spec.num_layers, *tensor.shape), (layer, *offsets), piece.unsqueeze(0))


def extra_state_objects(spec: ModelSpec, layer: int) -> Iterator[StoredObject]:
    """The per-layer ``_extra_state`` objects a NeMo training checkpoint carries (value None: no FP8 history)."""
    for module in EXTRA_STATE_MODULES:
        yield StoredObject(f"model.decoder.layers.{module}._extra_state/shard_{layer}_{spec.num_layers}", None)
