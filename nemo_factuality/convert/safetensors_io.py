"""Safetensors read and write, one tensor at a time, with memory bounded by the tensor in hand.

The ``safetensors`` package reads through ``mmap``, so every page it touches stays resident in the
converter's address space until the mapping closes; on a 64 GB checkpoint that is the whole model
in RSS. Here each tensor is ``readinto`` a fresh buffer from a plain file handle, which leaves the
bytes in the page cache (reclaimable) and not in the process.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length ``N``,
``N`` bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
with offsets relative to the end of the header, then the raw little-endian tensor bytes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import torch

from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # the reference implementation's limit
DEFAULT_SHARD_BYTES = 5 * 10**9  # what save_pretrained uses ("5GB")


class _Entry:
    __slots__ = ("file", "dtype", "shape", "begin", "end")

    def __init__(self, file: Path, dtype: torch.dtype, shape: tuple[int, ...], begin: int, end: int) -> None:
        self.file, self.dtype, self.shape, self.begin, self.end = file, dtype, shape, begin, end


def read_header(path: Path) -> dict[str, _Entry]:
    """Parse and validate one file's header: every tensor must lie inside the file and match its shape."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise FactualityInputError(f"{path} is corrupted or truncated ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise FactualityInputError(f"{path} is corrupted or truncated (header claims {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise FactualityInputError(f"{path} is corrupted or truncated (header is not JSON: {err})") from None
    entries, data_start = {}, 8 + n
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta.get("dtype") not in DTYPES:
            raise FactualityInputError(f"{path}: tensor {name!r} has unsupported dtype {meta.get('dtype')!r}")
        begin, end = meta["data_offsets"]
        dtype, shape = DTYPES[meta["dtype"]], tuple(meta["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or begin > end:
            raise FactualityInputError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {shape} {meta['dtype']}")
        if data_start + end > size:
            raise FactualityInputError(f"{path} is corrupted or truncated: tensor {name!r} ends at byte {data_start + end}, "
                                       f"the file has {size}; re-download or re-save the shard")
        entries[name] = _Entry(path, dtype, shape, data_start + begin, data_start + end)
    return entries


class SafetensorsReader:
    """All tensors of a (possibly sharded) checkpoint directory, read on demand."""

    def __init__(self, files: Iterable[Path]) -> None:
        self.entries: dict[str, _Entry] = {}
        for path in files:
            entries = read_header(path)
            clash = set(entries) & set(self.entries)
            if clash:
                raise FactualityInputError(f"{path}: tensors {sorted(clash)[:3]} also appear in another shard")
            self.entries.update(entries)
        self._handles: dict[Path, BinaryIO] = {}

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def get(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        handle = self._handles.get(e.file)
        if handle is None:
            handle = self._handles[e.file] = open(e.file, "rb")  # noqa: SIM115 - kept open for the reader's lifetime
        out = torch.empty(e.shape, dtype=e.dtype)
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        handle.seek(e.begin)
        got = handle.readinto(view) if out.numel() else 0
        if got != e.end - e.begin:
            raise FactualityInputError(f"{e.file}: tensor {name!r} is truncated ({got} of {e.end - e.begin} bytes)")
        return out

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()


def _header_bytes(plan: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in plan:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # keep tensor data 8-byte aligned, as the reference writer does


def plan_shards(plan: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int) -> list[list[int]]:
    """Group tensor indices into files of at most ``max_bytes`` (a bigger tensor gets a file of its own)."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, (_, dtype, shape) in enumerate(plan):
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += nbytes
    return shards


def write_sharded(out_dir: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]],
                  tensors: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """Stream ``tensors`` (in ``plan`` order) into ``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + index.

    The header of each file is written from ``plan`` first, so no tensor has to wait for the others.
    """
    shards = plan_shards(plan, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for file_name, indices in zip(names, shards):
        header = _header_bytes([plan[i] for i in indices], {"format": "pt"})
        with open(out_dir / file_name, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            for i in indices:
                name, dtype, shape = plan[i]
                got_name, t = next(tensors)
                assert got_name == name and t.dtype == dtype and tuple(t.shape) == shape, \
                    f"tensor stream out of plan: got {got_name} {t.dtype} {tuple(t.shape)}, planned {name} {dtype} {shape}"
                data = t.contiguous().view(-1).view(torch.uint8).numpy() if t.numel() else b""
                f.write(memoryview(data))
                weight_map[name] = file_name
                total += t.numel() * t.element_size()
            f.flush()
            os.fsync(f.fileno())
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    log.info("wrote %d tensors (%.1f MB) into %d safetensors file(s)", len(plan), total / 2**20, len(names))
    return names
