"""``model.megatron.attention_kernels=torch`` (``trainers/backends/megatron/paged_attention.py``): the dynamic engine's
paged-KV kernels in plain torch, against torch's own causal attention (``scaled_dot_product_attention``, dense,
unpaged) — the megatron backend's dynamic-engine tests run on these kernels.

Sequences of 5, 1 and 11 tokens, 8 query heads over 2 KV heads (grouped-query attention), their keys and values in
pages of 4 tokens scattered over a shuffled cache whose unwritten slots hold NaN (as uninitialised memory can: a
masked position let into a sum shows), unused table entries -1 as Megatron leaves them. Checked: packed prefill of whole sequences, a chunk of a sequence's last
queries over all its keys (the bottom-right causal alignment chunked prefill needs), decode from the cache, a decode
row without keys (a CUDA graph's padding request: zero, as flash-attn gives), the engine's padding rows. Decode reads
nothing on the host (it runs on fake tensors, which hold no values) and its operations' shapes do not depend on the
lengths — what a CUDA graph needs; prefill does read them (the check sees it). fp32,
tolerance 1e-5. With the causal mask one key off the checks fail (``test_the_checks_catch_a_mask_one_key_off``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nemo_factuality.trainers.backends.megatron import paged_attention as pa

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
    # NaN where no sequence wrote (the engine's cache is uninitialised memory): a kernel that lets one masked position
    # into its sums comes out NaN
    k_cache = torch.full((len(blocks), PAGE, KV_HEADS, D), float("nan"))
    v_cache = torch.full((len(blocks), PAGE, KV_HEADS, D), float("nan"))
    table = torch.full((len(LENGTHS), max(pages) + 1), -1, dtype=torch.int32)  # a spare column, as Megatron's
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
    out = pa.varlen(packed, k_cache, v_cache, _cu(LENGTHS), _cu(LENGTHS), max(LENGTHS), max(LENGTHS),
                                    causal=True, block_table=table)
    expected = torch.cat([_reference(*seq) for seq in zip(q, k, v, strict=True)])
    assert float((out[: sum(LENGTHS)] - expected).abs().max()) <= TOLERANCE
    assert bool((out[sum(LENGTHS):] == 0).all())


def test_a_chunk_of_last_queries_sees_every_earlier_key(paged):
    """Chunked prefill: each sequence's last 2 queries (1 for the 1-token one) over all of its keys, bottom-right."""
    q, k, v, k_cache, v_cache, table = paged
    chunk = [min(2, n) for n in LENGTHS]
    packed = torch.cat([qi[-c:] for qi, c in zip(q, chunk, strict=True)])
    out = pa.varlen(packed, k_cache, v_cache, _cu(chunk), _cu(LENGTHS), max(chunk), max(LENGTHS),
                                    causal=True, block_table=table)
    expected = torch.cat([_reference(*seq)[-c:] for seq, c in zip(zip(q, k, v, strict=True), chunk, strict=True)])
    assert float((out - expected).abs().max()) <= TOLERANCE


def test_unpaged_keys_equal_paged_ones(paged):
    q, k, v, k_cache, v_cache, table = paged
    out = pa.varlen(torch.cat(q), torch.cat(k), torch.cat(v), _cu(LENGTHS), _cu(LENGTHS), max(LENGTHS),
                                    max(LENGTHS), causal=True)
    assert float((out - torch.cat([_reference(*seq) for seq in zip(q, k, v, strict=True)])).abs().max()) <= TOLERANCE


def test_decode_from_the_cache_is_the_last_row_of_causal_attention(paged):
    q, k, v, k_cache, v_cache, table = paged
    last = torch.stack([qi[-1:] for qi in q])  # [batch, 1, heads, d]
    out = pa.decode(last, k_cache, v_cache, cache_seqlens=torch.tensor(LENGTHS, dtype=torch.int32),
                                     block_table=table, causal=True)
    expected = torch.stack([_reference(*seq)[-1:] for seq in zip(q, k, v, strict=True)])
    assert out.shape == last.shape and float((out - expected).abs().max()) <= TOLERANCE


def test_a_decode_row_without_keys_is_zero_not_nan(paged):
    q, k, v, k_cache, v_cache, table = paged
    last = torch.stack([qi[-1:] for qi in q])
    out = pa.decode(last, k_cache, v_cache, cache_seqlens=torch.tensor([5, 0, 11], dtype=torch.int32),
                    block_table=table, causal=True)
    assert bool((out[1] == 0).all()) and bool(torch.isfinite(out).all())
    expected = torch.stack([_reference(*seq)[-1:] for seq in zip(q, k, v, strict=True)])
    assert float((out[[0, 2]] - expected[[0, 2]]).abs().max()) <= TOLERANCE


class _Ops(TorchDispatchMode):
    """Every aten op called while active, with its output shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.calls.append((str(func), [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]))
        return out


def _decode_ops(paged, lengths: list[int]) -> list[tuple[str, list]]:
    q, k, v, k_cache, v_cache, table = paged
    last = torch.stack([qi[-1:] for qi in q])
    with _Ops() as ops:
        pa.decode(last, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32), block_table=table,
                  causal=True)
    return ops.calls


def test_decode_reads_nothing_on_the_host_and_its_shapes_do_not_follow_the_lengths(paged):
    """What a CUDA graph of the decode step needs: no device→host read — it runs on fake tensors, which hold shapes
    and no values (``.item()`` / ``.tolist()`` raise there) — and the same operations on the same shapes whatever the
    requests' lengths. Prefill reads its sequence lengths: on fake tensors it raises (the check sees a host read)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert _decode_ops(paged, LENGTHS) == _decode_ops(paged, [2, 1, 7])
    q, k, v, k_cache, v_cache, table = paged
    last, lengths, packed, cu = torch.stack([qi[-1:] for qi in q]), torch.tensor(LENGTHS, dtype=torch.int32), \
        torch.cat(q), _cu(LENGTHS)
    mode = FakeTensorMode()
    fake = [mode.from_tensor(t) for t in (last, k_cache, v_cache, lengths, table)]
    packed = [mode.from_tensor(t) for t in (packed, cu)]
    with mode:
        assert pa.decode(*fake[:3], cache_seqlens=fake[3], block_table=fake[4], causal=True).shape == last.shape
        with pytest.raises(Exception, match="_local_scalar_dense"):  # the host read (.tolist())
            pa.varlen(packed[0], fake[1], fake[2], packed[1], packed[1], max(LENGTHS), max(LENGTHS), causal=True,
                      block_table=fake[4])


def test_the_checks_catch_a_mask_one_key_off(paged, monkeypatch):
    """The causal mask shifted by one key either way: prefill and decode leave the tolerance."""
    q, k, v, k_cache, v_cache, table = paged
    visible = pa._visible
    expected = torch.cat([_reference(*seq) for seq in zip(q, k, v, strict=True)])
    for shift in (1, -1):
        monkeypatch.setattr(pa, "_visible", lambda q_len, k_lens, width, causal, s=shift: visible(q_len, k_lens + s,
                                                                                                 width, causal))
        out = pa.varlen(torch.cat(q), k_cache, v_cache, _cu(LENGTHS), _cu(LENGTHS), max(LENGTHS), max(LENGTHS),
                        causal=True, block_table=table)
        assert float((out - expected).abs().max()) > 100 * TOLERANCE or not bool(torch.isfinite(out).all())


def test_use_torch_kernels_binds_them_in_megatron_only(monkeypatch):
    """Megatron's attention module calls them and its dynamic-batching version check accepts them; nothing named
    ``flash_attn`` is put anywhere (an installed flash-attn stays what ``import flash_attn`` gives)."""
    import sys

    attention = pytest.importorskip("megatron.core.transformer.attention")
    for name in ("flash_attn_varlen_func", "flash_attn_with_kvcache", "is_fa_min_version"):  # put back afterwards
        monkeypatch.setattr(attention, name, getattr(attention, name))
    monkeypatch.setattr(attention, "_nemo_factuality_torch_kernels", False, raising=False)
    before = sys.modules.get("flash_attn")
    pa.use_torch_kernels()
    assert attention.flash_attn_varlen_func is pa.varlen and attention.flash_attn_with_kvcache is pa.decode
    assert attention.is_fa_min_version("2.7.3") and sys.modules.get("flash_attn") is before
