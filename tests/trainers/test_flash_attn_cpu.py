"""The flash-attn stand-in the dynamic engine's CPU tests run on (``testing/flash_attn_cpu.py``) against torch's own
causal attention (``scaled_dot_product_attention``, dense, unpaged): the engine tests' truth rests on it.

Sequences of 5, 1 and 11 tokens, 8 query heads over 2 KV heads (grouped-query attention), their keys and values in
pages of 4 tokens scattered over a shuffled cache (so a wrong page or position reads another sequence's keys). Checked:
packed prefill of whole sequences, a chunk of a sequence's last queries over all its keys (the bottom-right causal
alignment chunked prefill needs), one-token decode from the cache, the engine's padding rows. fp32: observed 0
(prefill) and 2.2e-7 (decode); tolerance 1e-5. By hand, the stand-in's causal mask one key off fails them: one key
too many gives differences of 2.8 (prefill) and 0.59 (the chunk), one too few NaN (a first query sees no key).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest
import torch

from nemo_factuality.testing import flash_attn_cpu as fa

TOLERANCE = 1e-5
HEADS, KV_HEADS, D, PAGE = 8, 2, 16, 4
LENGTHS = [5, 1, 11]


@pytest.fixture(scope="module")
def paged():
    """Per sequence ``q`` / ``k`` / ``v`` ``[len, heads, d]``, the paged caches ``[blocks, PAGE, kv_heads, d]`` holding
    the keys and values, and the ``[sequences, pages]`` block table."""
    gen = torch.Generator().manual_seed(0)
    q = [torch.randn(n, HEADS, D, generator=gen) for n in LENGTHS]
    k = [torch.randn(n, KV_HEADS, D, generator=gen) for n in LENGTHS]
    v = [torch.randn(n, KV_HEADS, D, generator=gen) for n in LENGTHS]
    pages = [-(-n // PAGE) for n in LENGTHS]
    blocks = torch.randperm(sum(pages) + 3, generator=gen)  # shuffled, some pages unused
    k_cache = torch.randn(len(blocks), PAGE, KV_HEADS, D, generator=gen)  # garbage where no sequence wrote
    v_cache = torch.randn(len(blocks), PAGE, KV_HEADS, D, generator=gen)
    table = torch.zeros(len(LENGTHS), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(LENGTHS):
        table[i, : pages[i]] = blocks[used : used + pages[i]].int()
        used += pages[i]
        for pos in range(n):
            k_cache[table[i, pos // PAGE], pos % PAGE] = k[i][pos]
            v_cache[table[i, pos // PAGE], pos % PAGE] = v[i][pos]
    return q, k, v, k_cache, v_cache, table


def _reference(q, k, v):
    """torch's causal attention over one whole sequence: ``[len, heads, d]``."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                           is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_packed_prefill_from_pages_equals_causal_attention(paged):
    q, k, v, k_cache, v_cache, table = paged
    packed = torch.cat([*q, torch.randn(3, HEADS, D)])  # 3 padding rows past the last sequence, as the engine pads
    out = fa.flash_attn_varlen_func(packed, k_cache, v_cache, _cu(LENGTHS), _cu(LENGTHS), max(LENGTHS), max(LENGTHS),
                                    causal=True, block_table=table)
    expected = torch.cat([_reference(*seq) for seq in zip(q, k, v, strict=True)])
    assert float((out[: sum(LENGTHS)] - expected).abs().max()) <= TOLERANCE
    assert bool((out[sum(LENGTHS):] == 0).all())


def test_a_chunk_of_last_queries_sees_every_earlier_key(paged):
    """Chunked prefill: each sequence's last 2 queries (1 for the 1-token one) over all of its keys, bottom-right."""
    q, k, v, k_cache, v_cache, table = paged
    chunk = [min(2, n) for n in LENGTHS]
    packed = torch.cat([qi[-c:] for qi, c in zip(q, chunk, strict=True)])
    out = fa.flash_attn_varlen_func(packed, k_cache, v_cache, _cu(chunk), _cu(LENGTHS), max(chunk), max(LENGTHS),
                                    causal=True, block_table=table)
    expected = torch.cat([_reference(*seq)[-c:] for seq, c in zip(zip(q, k, v, strict=True), chunk, strict=True)])
    assert float((out - expected).abs().max()) <= TOLERANCE


def test_unpaged_keys_equal_paged_ones(paged):
    q, k, v, k_cache, v_cache, table = paged
    out = fa.flash_attn_varlen_func(torch.cat(q), torch.cat(k), torch.cat(v), _cu(LENGTHS), _cu(LENGTHS), max(LENGTHS),
                                    max(LENGTHS), causal=True)
    assert float((out - torch.cat([_reference(*seq) for seq in zip(q, k, v, strict=True)])).abs().max()) <= TOLERANCE


def test_decode_from_the_cache_is_the_last_row_of_causal_attention(paged):
    q, k, v, k_cache, v_cache, table = paged
    last = torch.stack([qi[-1:] for qi in q])  # [batch, 1, heads, d]
    out = fa.flash_attn_with_kvcache(last, k_cache, v_cache, cache_seqlens=torch.tensor(LENGTHS, dtype=torch.int32),
                                     block_table=table, causal=True)
    expected = torch.stack([_reference(*seq)[-1:] for seq in zip(q, k, v, strict=True)])
    assert out.shape == last.shape and float((out - expected).abs().max()) <= TOLERANCE


def test_install_is_a_module_transformers_does_not_take_for_flash_attn():
    """Installed as ``flash_attn`` with Megatron's minimum version; transformers' probe (``find_spec`` then the
    distribution's metadata) must neither raise nor find a flash-attn to use; a real flash-attn is never shadowed."""
    present = sys.modules.pop("flash_attn", None)
    try:
        if present is not None and not getattr(present, "IS_CPU_STAND_IN", False):
            pytest.skip("a real flash-attn is imported here")
        module = fa.install()
        assert fa.install() is module and module.__version__ == "2.7.3"
        assert importlib.util.find_spec("flash_attn") is not None
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("flash_attn")
        sys.modules["flash_attn"] = type(sys)("flash_attn")  # a real one (no stand-in mark)
        with pytest.raises(RuntimeError, match="shadow"):
            fa.install()
    finally:
        sys.modules.pop("flash_attn", None)
        if present is not None:
            sys.modules["flash_attn"] = present
