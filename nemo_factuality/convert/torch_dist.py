"""Megatron-Core ``torch_dist`` checkpoints, written and read one chunk at a time.

A ``torch_dist`` directory is a PyTorch Distributed Checkpoint (DCP) plus two Megatron files:

    metadata.json    {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", ...}
    common.pt        torch.save of the non-sharded state ({} for model weights)
    .metadata        pickled ``torch.distributed.checkpoint.metadata.Metadata``: per global tensor its size,
                     dtype and chunks (offsets, sizes), and where each chunk's bytes live
    __0_<k>.distcp   chunks, each one ``torch.save(chunk)`` blob at a recorded offset

``dist_checkpointing.save`` needs the whole state dict in memory and stages a copy of it; this
writer takes chunks as they are produced, so a conversion holds a few tensors at a time. Files are
written per *group* (the embedding, one decoder layer, the head): each group goes to a temp file,
is fsynced and renamed, then appended to a journal, so an interrupted conversion resumes at the
first unfinished group. What Megatron's loader accepts is checked in the tests against checkpoints
that ``dist_checkpointing.save`` writes itself (same keys, sizes, dtypes and chunk grid).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from unittest.mock import patch

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo  # the DCP format's per-chunk record
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)
MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}
JOURNAL = ".progress.jsonl"


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a global tensor ``fqn`` of shape ``global_shape``, at ``offsets``."""

    fqn: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor  # shape = the chunk's sizes

    def __post_init__(self) -> None:
        assert len(self.offsets) == len(self.global_shape) == self.data.dim(), (self.fqn, self.offsets, self.global_shape)
        assert all(o + s <= g for o, s, g in zip(self.offsets, self.data.shape, self.global_shape)), \
            f"{self.fqn}: chunk at {self.offsets} of size {tuple(self.data.shape)} exceeds {self.global_shape}"


@dataclass(frozen=True)
class StoredObject:
    """A Megatron ``ShardedObject`` as DCP stores it: ``torch.save([value])`` bytes under its unique key
    (``<key>/shard_<offset>_<shape>``), e.g. a layer's ``_extra_state``."""

    unique_key: str
    value: object = None

    def payload(self) -> bytes:
        buffer = io.BytesIO()
        torch.save([self.value], buffer)  # Megatron saves the list of the rank's shards of this object
        return buffer.getvalue()


class TorchDistWriter:
    """Streams chunks into a torch_dist directory; ``finish()`` writes the metadata Megatron needs.

    ``groups_done()`` lists what a previous, interrupted run already wrote (its journal is replayed
    and every file's size checked), so callers skip those groups.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._records: list[dict] = []
        self._replay_journal()

    def _replay_journal(self) -> None:
        journal = self.dir / JOURNAL
        if not journal.is_file():
            return
        for n, line in enumerate(journal.read_text().splitlines(), 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s line %d is incomplete (interrupted while appending); that group is redone", journal, n)
                break
            path = self.dir / record["file"]
            if not path.is_file() or path.stat().st_size != record["size"]:
                log.warning("%s: %s is missing or has the wrong size; group %s is redone", journal, record["file"], record["group"])
                break
            self._records.append(record)
        # rewrite the journal with just the intact prefix, and drop files no record owns
        journal.write_text("".join(json.dumps(r) + "\n" for r in self._records))
        owned = {r["file"] for r in self._records}
        for path in self.dir.glob("__*.distcp*"):
            if path.name not in owned:
                path.unlink()

    def groups_done(self) -> dict[str, dict]:
        """``{group: extra}`` for the groups already on disk (``extra`` is what ``write_group`` was given)."""
        return {r["group"]: r["extra"] for r in self._records}

    def write_group(self, group: str, chunks: Iterable[Chunk | StoredObject], extra: dict | None = None) -> None:
        """Write one group's chunks to ``__0_<k>.distcp`` (temp file, fsync, rename, journal line)."""
        assert group not in self.groups_done(), f"group {group!r} written twice"
        name = f"__0_{len(self._records)}.distcp"
        tmp = self.dir / (name + ".tmp")
        items = []
        with open(tmp, "wb") as f:
            for chunk in chunks:
                if isinstance(chunk, StoredObject):
                    start = f.tell()
                    f.write(chunk.payload())
                    items.append({"object": chunk.unique_key, "offset": start, "length": f.tell() - start})
                    continue
                data = chunk.data.detach().cpu()
                if data.untyped_storage().nbytes() != data.numel() * data.element_size() or not data.is_contiguous():
                    data = data.contiguous().clone()  # torch.save writes the whole storage: store only this chunk
                start = f.tell()
                torch.save(data, f)
                items.append({"fqn": chunk.fqn, "global_shape": list(chunk.global_shape), "offsets": list(chunk.offsets),
                              "sizes": list(data.shape), "dtype": str(data.dtype).removeprefix("torch."),
                              "offset": start, "length": f.tell() - start})
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / name)
        record = {"group": group, "file": name, "size": (self.dir / name).stat().st_size, "items": items, "extra": extra or {}}
        with open(self.dir / JOURNAL, "a") as j:
            j.write(json.dumps(record) + "\n")
            j.flush()
            os.fsync(j.fileno())
        self._records.append(record)

    def finish(self) -> Metadata:
        """Write ``.metadata``, ``metadata.json`` and ``common.pt``; remove the journal."""
        tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for record in self._records:
            for it in record["items"]:
                if "object" in it:
                    tensors[it["object"]] = BytesStorageMetadata()
                    storage[MetadataIndex(it["object"])] = _StorageInfo(record["file"], it["offset"], it["length"])
                    continue
                dtype = getattr(torch, it["dtype"])
                size = torch.Size(it["global_shape"])
                md = tensors.setdefault(it["fqn"], TensorStorageMetadata(TensorProperties(dtype=dtype), size, []))
                if md.size != size or md.properties.dtype != dtype:
                    raise ValueError(f"{it['fqn']}: chunks disagree on the global shape/dtype ({md.size} vs {size})")
                offsets = torch.Size(it["offsets"])
                md.chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(it["sizes"])))
                storage[MetadataIndex(it["fqn"], offsets)] = _StorageInfo(record["file"], it["offset"], it["length"])
        for fqn, md in tensors.items():
            if isinstance(md, BytesStorageMetadata):
                continue
            covered = sum(torch.Size(c.sizes).numel() for c in md.chunks)
            if covered != md.size.numel():
                raise ValueError(f"{fqn}: chunks cover {covered} of {md.size.numel()} elements")
        metadata = Metadata(state_dict_metadata=tensors, planner_data={}, storage_data=storage,
                            storage_meta=StorageMeta(checkpoint_id=str(self.dir), save_id=str(uuid.uuid4())))
        metadata.version = "1.0.0"  # DCP's CURRENT_DCP_VERSION when this format was pinned
        with open(self.dir / ".metadata.tmp", "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.dir / ".metadata.tmp", self.dir / ".metadata")
        torch.save({}, self.dir / "common.pt")
        (self.dir / "metadata.json").write_text(json.dumps(MEGATRON_METADATA))
        (self.dir / JOURNAL).unlink(missing_ok=True)
        return metadata


# What a DCP ``.metadata`` pickle may name (torch 2.x and Megatron's planners); anything else is refused.
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan",
                                             "ReadItem", "LoadItemType"},
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreSavePlan"},
    "torch.serialization": {"_get_layout"},  # maps a layout's name to the torch.layout object
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    # StorageMeta.checkpoint_id is the save directory as a Path when Megatron's async writer saved it (what
    # NeMo's save_to of a trained policy writes); building a path object runs no code from the file.
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: a global outside the allow-list (e.g. ``os.system`` in a ``__reduce__``) raises."""

    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)  # torch.float32, torch.strided, torch.contiguous_format, ...
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not part of checkpoint metadata")


def load_dcp_metadata(path: Path) -> Metadata:
    """The DCP ``Metadata`` in ``path``, unpickled with an allow-list of DCP classes (no code runs from the file)."""
    try:
        with open(path, "rb") as f:
            metadata = _DCPMetadataUnpickler(f).load()
    except pickle.UnpicklingError as err:
        if "not part of checkpoint metadata" in str(err):
            raise FactualityInputError(f"{path}: refusing to unpickle: {err}. A checkpoint's metadata never needs it; "
                                       "the file may be crafted to run code. Do not use this checkpoint") from None
        raise FactualityInputError(f"{path} is corrupted or truncated ({err})") from None
    except Exception as err:  # any other unpickling failure means a damaged file
        raise FactualityInputError(f"{path} is corrupted or truncated ({err})") from None
    if not isinstance(metadata, Metadata):
        raise FactualityInputError(f"{path} holds a {type(metadata).__name__}, not DCP checkpoint metadata")
    return metadata


@contextmanager
def untrusted_checkpoint_loading(weights_dir: Path) -> Iterator[None]:
    """Guard Megatron's ``dist_checkpointing.load`` of a checkpoint from anywhere: no code runs from its files.

    Torch DCP reads ``.metadata`` with plain ``pickle.load`` and non-tensor objects (``_extra_state``) with
    ``torch.load(weights_only=False)``. The metadata is checked with the allow-list unpickler first (the plain
    load then builds the same harmless objects), and objects are loaded ``weights_only=True`` meanwhile.
    """
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    load_dcp_metadata(Path(weights_dir) / ".metadata")

    def load_bytes(planner, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise FactualityInputError(f"{weights_dir}: refusing to load object {fqn!r}: {err}") from None
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[fqn], obj)
        else:
            planner.state_dict[fqn] = obj

    with patch.object(DefaultLoadPlanner, "load_bytes", load_bytes):
        yield


class TorchDistReader:
    """Reads global tensors (or one index of their leading axis) from any torch_dist directory by chunks.

    Works on checkpoints written by Megatron/NeMo at any TP/PP: the requested region is assembled from
    the chunks that overlap it, so memory is the region plus one chunk.
    """

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        meta_path = self.dir / ".metadata"
        if not (self.dir / "metadata.json").is_file() or not meta_path.is_file():
            raise FactualityInputError(f"{self.dir} is not a torch_dist checkpoint (needs metadata.json and .metadata)")
        backend = json.loads((self.dir / "metadata.json").read_text()).get("sharded_backend")
        if backend != "torch_dist":
            raise FactualityInputError(f"{self.dir}: sharded_backend is {backend!r}; only torch_dist is supported "
                                       "(convert zarr checkpoints with NeMo's convert_zarr_to_torch_dist.py first)")
        self.metadata = load_dcp_metadata(meta_path)
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

    def keys(self) -> list[str]:
        return list(self.tensors)

    def object_keys(self) -> list[str]:
        """Unique keys of the stored non-tensor objects (e.g. ``..._extra_state/shard_<layer>_<layers>``)."""
        return [k for k in self.metadata.state_dict_metadata if k not in self.tensors]

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self.tensors[fqn].size)

    def dtype(self, fqn: str) -> torch.dtype:
        return self.tensors[fqn].properties.dtype

    def _load_chunk(self, fqn: str, chunk: ChunkStorageMetadata) -> torch.Tensor:
        info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
        path = self.dir / info.relative_path
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) < info.offset + info.length:
                raise FactualityInputError(f"{path} is truncated: chunk of {fqn!r} needs bytes {info.offset}.."
                                           f"{info.offset + info.length}, the file has {f.tell()}")
            try:  # torch.load reads the blob through a window on the file: no second copy of the bytes
                data = torch.load(_FileWindow(f, info.offset, info.length), map_location="cpu", weights_only=True)
            except Exception as err:  # torch raises several types for damaged zip payloads
                raise FactualityInputError(f"{path}: chunk of {fqn!r} is corrupted ({err})") from None
        if tuple(data.shape) != tuple(chunk.sizes):
            raise FactualityInputError(f"{path}: chunk of {fqn!r} has shape {tuple(data.shape)}, metadata says {tuple(chunk.sizes)}")
        return data

    def _tensor_metadata(self, fqn: str) -> TensorStorageMetadata:
        if fqn not in self.tensors:
            raise FactualityInputError(f"{self.dir}: no tensor {fqn!r} (has {sorted(self.tensors)[:4]}...)")
        return self.tensors[fqn]

    def meta(self, fqn: str, index: int | None = None) -> torch.Tensor:
        """What ``read(fqn, index)`` would return, as a data-less ``meta`` tensor (shape and dtype only)."""
        md = self._tensor_metadata(fqn)
        size = tuple(md.size)[1:] if index is not None else tuple(md.size)
        return torch.empty(size, dtype=md.properties.dtype, device="meta")

    def read(self, fqn: str, index: int | None = None) -> torch.Tensor:
        """The global tensor ``fqn``, or just ``fqn[index]`` (one layer of a layer-stacked tensor)."""
        md = self._tensor_metadata(fqn)
        size = tuple(md.size)
        lo = [0] * len(size)
        if index is not None:
            assert 0 <= index < size[0], f"{fqn}: index {index} outside leading size {size[0]}"
            lo[0], size = index, (1, *size[1:])
        exact = [c for c in md.chunks if tuple(c.offsets) == tuple(lo) and tuple(c.sizes) == size]
        if exact:  # one chunk is exactly the region (TP=1 layouts): hand it over without a copy
            data = self._load_chunk(fqn, exact[0])
            return data[0] if index is not None else data
        out = torch.empty(size, dtype=md.properties.dtype)
        filled = 0
        for chunk in md.chunks:
            start = [max(o, low) for o, low in zip(chunk.offsets, lo, strict=True)]
            stop = [min(o + s, low + n) for o, s, low, n in zip(chunk.offsets, chunk.sizes, lo, size, strict=True)]
            if any(a >= b for a, b in zip(start, stop)):
                continue
            data = self._load_chunk(fqn, chunk)
            src, dst = data, out
            for dim, (a, b) in enumerate(zip(start, stop)):
                src = src.narrow(dim, a - chunk.offsets[dim], b - a)
                dst = dst.narrow(dim, a - lo[dim], b - a)
            dst.copy_(src)
            filled += src.numel()
        if filled != out.numel():
            raise FactualityInputError(f"{self.dir}: chunks of {fqn!r} cover {filled} of {out.numel()} elements")
        return out[0] if index is not None else out


class _FileWindow(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``offset`` of an open file."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got
