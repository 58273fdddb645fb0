"""Paged attention in plain torch for Megatron-Core 0.16.1's dynamic inference engine: ``model.megatron.attention_kernels
=torch``, for machines without flash-attn (pip-installed nodes, the lent GPU machine, CPUs).

Megatron's dynamic engine attends only through two flash-attn 2 kernels its attention module binds at import
(``core/transformer/attention.py``: ``flash_attn_varlen_func`` for prefill, ``flash_attn_with_kvcache`` for decode),
both reading its paged KV cache: ``k_cache`` / ``v_cache`` ``[blocks, block_size, kv_heads, d]``, ``block_table[i, j]``
the block holding positions ``j·block_size …`` of sequence ``i``. Causal attention is bottom-right aligned (query ``t``
of a sequence with ``q_len`` queries and ``k_len`` keys sees keys ``0 … k_len − q_len + t``); grouped-query heads read
KV head ``h // (heads / kv_heads)``. ``use_torch_kernels()`` binds the two functions below in their place — in
Megatron's attention module only: an installed flash-attn stays importable and unshadowed everywhere else.

* ``decode``: every request at once, in fixed shapes and without a host sync — each request's pages gathered to the
  block table's full width (``blocks per request × block_size`` positions), positions past its length masked, one SDPA
  call (``enable_gqa``) — so a CUDA graph can capture it. Its cost is the table's width, not the request's length:
  ``2 · B · width · kv_heads · d`` elements gathered per layer and step.
* ``varlen``: prefill (eager: it reads ``cu_seqlens`` on the host), one SDPA call per sequence.

Checked on CPU against SDPA over the unpaged keys and against the per-sequence reference
(``tests/trainers/test_paged_attention.py``); on a GPU not measured (no GPU in the session that wrote it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pages(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """``[B, blocks·block_size, kv_heads, d]``: each row's pages in order (unused table entries, e.g. -1, read block 0;
    the caller masks them)."""
    b, blocks = block_table.shape
    gathered = cache[block_table.clamp(min=0).long()]  # [B, blocks, block_size, kv_heads, d]
    return gathered.reshape(b, blocks * cache.shape[1], *cache.shape[2:])


def _visible(q_len: int, k_lens: torch.Tensor, width: int, causal: bool) -> torch.Tensor:
    """``[B, 1, q_len, width]`` bool: key ``j`` is visible to query ``t`` of row ``i`` when ``j < k_lens[i]`` and, causal,
    ``j <= k_lens[i] − q_len + t`` (bottom-right aligned)."""
    keys = torch.arange(width, device=k_lens.device)
    if causal:
        last = k_lens[:, None] - q_len + torch.arange(q_len, device=k_lens.device)[None, :]  # [B, q_len]
        return (keys[None, None, :] <= last[:, :, None]).unsqueeze(1)
    return (keys[None, :] < k_lens[:, None])[:, None, None, :].expand(-1, 1, q_len, -1)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [B, q_len, H, d]``, ``k`` / ``v`` ``[B, k_len, KV, d]``, ``mask [B, 1, q_len, k_len]`` → ``[B, q_len, H, d]``."""
    assert q.shape[2] % k.shape[2] == 0, (q.shape, k.shape)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
                                         attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
           block_table: torch.Tensor, causal: bool = True, softmax_scale: float | None = None, num_splits: int = 0,
           **unsupported) -> torch.Tensor:
    """flash-attn's ``flash_attn_with_kvcache`` as Megatron calls it (the cache already holds the new tokens):
    ``q [B, q_len, H, d]``, row ``i`` ``cache_seqlens[i]`` keys long in the pages of ``block_table[i]`` →
    ``[B, q_len, H, d]``. Fixed shapes, no host sync (module docstring)."""
    if any(v is not None for v in unsupported.values()):
        raise NotImplementedError(f"paged_attention.decode: {sorted(k for k, v in unsupported.items() if v is not None)}")
    k, v = _pages(k_cache, block_table), _pages(v_cache, block_table)
    # positions past a row's length hold whatever the cache's memory held (NaN too): a masked score still multiplies
    # its value by 0, and 0 · NaN is NaN, so they are zeroed, not just masked
    written = (torch.arange(k.shape[1], device=k.device)[None, :] < cache_seqlens.long()[:, None])[:, :, None, None]
    k, v = k.masked_fill(~written, 0), v.masked_fill(~written, 0)
    mask = _visible(q.shape[1], cache_seqlens.long(), k.shape[1], causal)
    # a row with no key (a CUDA graph's padding request) attends to position 0 and comes out zero, as flash-attn's
    # does, instead of NaN; a mask op, not a branch on the host
    empty = ~mask.any(dim=-1, keepdim=True)
    mask = mask | (empty & (torch.arange(k.shape[1], device=mask.device) == 0))
    out = _sdpa(q, k, v, mask, softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5)
    return out * (~empty).transpose(1, 2).to(out.dtype)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0, softmax_scale: float | None = None,
           causal: bool = False, block_table: torch.Tensor | None = None, **_unused) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func``: packed ``q [total_q, H, d]``, sequence ``i``'s queries rows
    ``cu_seqlens_q[i] … cu_seqlens_q[i+1]``, its ``cu_seqlens_k[i+1] − cu_seqlens_k[i]`` keys read from the pages of
    ``block_table[i]`` (``k`` / ``v`` the paged caches) or, without a table, rows of ``k`` / ``v`` ``[total_k, KV, d]``.
    Rows of ``q`` past the last sequence (the engine's padding) come out zero."""
    if dropout_p:
        raise NotImplementedError("paged_attention.varlen has no dropout (inference only)")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # prefill runs eagerly: a host read is fine here
    for i in range(len(cu_q) - 1):
        q_len, k_len = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if q_len == 0:
            continue
        if block_table is None:
            k_i, v_i = k[cu_k[i]: cu_k[i + 1]][None], v[cu_k[i]: cu_k[i + 1]][None]
        else:
            k_i, v_i = _pages(k, block_table[i: i + 1])[:, :k_len], _pages(v, block_table[i: i + 1])[:, :k_len]
        mask = _visible(q_len, torch.tensor([k_len], device=q.device), k_len, causal)
        out[cu_q[i]: cu_q[i + 1]] = _sdpa(q[None, cu_q[i]: cu_q[i + 1]], k_i, v_i, mask, scale)[0]
    return out


def is_torch_kernel(fn: object) -> bool:
    """``fn`` is one of this module's kernels (or a wrapper that keeps its attributes, e.g. ``functools.wraps``)."""
    return bool(getattr(fn, "_paged_attention_torch_kernel", False))


varlen._paged_attention_torch_kernel = decode._paged_attention_torch_kernel = True


def use_torch_kernels() -> None:
    """Megatron's attention module calls ``varlen`` and ``decode`` for its dynamic engine from now on (this process),
    and its flash-attn version check for dynamic batching accepts them; nothing named ``flash_attn`` is touched."""
    from megatron.core.transformer import attention

    if getattr(attention, "_nemo_factuality_torch_kernels", False):
        return
    flash_version_ok = attention.is_fa_min_version

    def version_ok(version: str, check_equality: bool = True) -> bool:
        # the only check in this module is the dynamic engine's, of the kernels it calls: these
        return is_torch_kernel(attention.flash_attn_with_kvcache) or flash_version_ok(version, check_equality)

    attention.flash_attn_varlen_func, attention.flash_attn_with_kvcache = varlen, decode
    attention.is_fa_min_version = version_ok
    attention._nemo_factuality_torch_kernels = True
