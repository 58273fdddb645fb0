"""Test support: a reference (plain torch, any device) stand-in for the two flash-attn 2 kernels Megatron-Core 0.16.1's
dynamic inference engine calls, so that the engine runs where flash-attn cannot be installed (CPU CI).

Never imported by production code. ``install()`` puts a module named ``flash_attn`` in ``sys.modules`` (version 2.7.3,
the least ``core/transformer/attention.py`` accepts for dynamic batching); call it before anything imports
``megatron.core.transformer.attention``, which binds ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` at import.

Both read the engine's paged KV cache: ``k_cache`` / ``v_cache`` ``[blocks, block_size, kv_heads, d]``, and
``block_table[i, j]`` the block holding positions ``j·block_size .. (j+1)·block_size − 1`` of sequence ``i``. Causal
attention is bottom-right aligned, as flash-attn's is when a sequence has fewer queries than keys: query ``t`` of a
sequence with ``q_len`` queries and ``k_len`` keys sees keys ``0 .. k_len − q_len + t``. Grouped-query attention:
query head ``h`` reads KV head ``h // (heads / kv_heads)``. It is a loop over sequences in fp32: slow, and exact.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

VERSION = "2.7.3"


def _gather_pages(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, kv_heads, d]``: the first ``length`` positions of one sequence from its pages ``blocks``."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    return cache[blocks.long()[pos // block_size], pos % block_size]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One sequence: ``q [q_len, heads, d]``, ``k`` / ``v`` ``[k_len, kv_heads, d]`` → ``[q_len, heads, d]``."""
    q_len, heads, _ = q.shape
    k_len, kv_heads, _ = k.shape
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=1).float(), v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [heads, q_len, k_len]
    if causal:
        # bottom-right aligned: the last query sees every key
        last_key = torch.arange(q_len, device=q.device) + (k_len - q_len)
        hidden = torch.arange(k_len, device=q.device)[None, :] > last_key[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, block_table=None, **_unused):
    """Packed sequences: ``q [total_q, heads, d]``; sequence ``i``'s queries are rows ``cu_seqlens_q[i] ..
    cu_seqlens_q[i+1]``, its keys ``cu_seqlens_k[i+1] − cu_seqlens_k[i]`` long, read from the pages of
    ``block_table[i]`` when given (``k`` / ``v`` then the paged caches), else rows of ``k`` / ``v`` ``[total_k,
    kv_heads, d]``. Rows of ``q`` past the last sequence (the engine's padding) come out zero."""
    assert dropout_p == 0.0, "the stand-in has no dropout"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q_i = q[cu_q[i]: cu_q[i + 1]]
        k_len = cu_k[i + 1] - cu_k[i]
        if q_i.shape[0] == 0:
            continue
        if block_table is None:
            k_i, v_i = k[cu_k[i]: cu_k[i + 1]], v[cu_k[i]: cu_k[i + 1]]
        else:
            k_i, v_i = _gather_pages(k, block_table[i], k_len), _gather_pages(v, block_table[i], k_len)
        out[cu_q[i]: cu_q[i + 1]] = _attend(q_i, k_i, v_i, scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, **_unused):
    """Decode against a paged cache that already holds the new tokens (Megatron appends them itself, so ``k`` / ``v``
    and the rotary arguments are refused): ``q [batch, q_len, heads, d]``, sequence ``i`` ``cache_seqlens[i]`` keys
    long in the pages of ``block_table[i]`` → ``[batch, q_len, heads, d]``."""
    if any(x is not None for x in (k, v, rotary_cos, rotary_sin, cache_batch_idx, cache_leftpad)):
        raise NotImplementedError("flash_attn stand-in: only a cache that already holds the keys is read")
    assert block_table is not None and cache_seqlens is not None, "flash_attn stand-in: paged cache only"
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for i, length in enumerate(cache_seqlens.tolist()):
        k_i, v_i = _gather_pages(k_cache, block_table[i], length), _gather_pages(v_cache, block_table[i], length)
        out[i] = _attend(q[i], k_i, v_i, scale, causal)
    return out


def install() -> types.ModuleType:
    """``import flash_attn`` gives this module's two kernels from now on (in this process). Idempotent; refuses to
    shadow a real flash-attn."""
    present = sys.modules.get("flash_attn")
    if present is not None:
        if getattr(present, "IS_CPU_STAND_IN", False):
            return present
        raise RuntimeError("flash_attn is already imported: the CPU stand-in would shadow the real kernels")
    module = types.ModuleType("flash_attn")
    module.__version__ = VERSION
    # a spec without a distribution: transformers' find_spec probe (``is_flash_attn_2_available``) then finds no
    # installed flash-attn and keeps its own attention; with no spec at all the probe raises
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    module.IS_CPU_STAND_IN = True
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    sys.modules["flash_attn"] = module
    return module
