"""The streaming building blocks on hand-made tensors: safetensors I/O and the torch_dist chunk writer/reader."""

from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_factuality.convert.safetensors_io import SafetensorsReader, plan_shards, write_sharded
from nemo_factuality.convert.torch_dist import JOURNAL, Chunk, TorchDistReader, TorchDistWriter
from nemo_factuality.types import FactualityInputError


def test_reader_matches_the_safetensors_package_for_every_dtype(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
               "d": torch.randn(2, 2).half(), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    reader = SafetensorsReader([tmp_path / "x.safetensors"])
    assert sorted(reader.keys()) == sorted(tensors)
    for k, t in tensors.items():
        got = reader.get(k)
        assert got.dtype == t.dtype and torch.equal(got, t)
    reader.close()


def test_reader_rejects_truncation_before_reading_anything(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "x.safetensors"))
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "x.safetensors").write_bytes(data[:-10])
    with pytest.raises(FactualityInputError, match="corrupted or truncated: tensor 'w' ends at byte"):
        SafetensorsReader([tmp_path / "x.safetensors"])
    (tmp_path / "y.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")
    with pytest.raises(FactualityInputError, match="header claims"):
        SafetensorsReader([tmp_path / "y.safetensors"])
    (tmp_path / "z.safetensors").write_bytes(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(FactualityInputError, match="header is not JSON"):
        SafetensorsReader([tmp_path / "z.safetensors"])


def test_write_sharded_streams_in_plan_order_and_indexes(tmp_path):
    tensors = [(f"t{i}", torch.full((10, 10), float(i))) for i in range(5)]  # 400 bytes each
    plan = [(n, t.dtype, tuple(t.shape)) for n, t in tensors]
    assert plan_shards(plan, 1000) == [[0, 1], [2, 3], [4]]
    names = write_sharded(tmp_path, plan, iter(tensors), max_shard_bytes=1000)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2000 and index["weight_map"]["t4"] == names[2]
    loaded = {k: v for n in names for k, v in load_file(str(tmp_path / n)).items()}
    assert all(torch.equal(loaded[n], t) for n, t in tensors)
    with pytest.raises(AssertionError, match="out of plan"):
        write_sharded(tmp_path, plan, iter(reversed(tensors)))


def _layered_chunks(layer: int, tp: int = 2) -> list[Chunk]:
    w = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + 100 * layer
    return [Chunk("m.w", (3, 8, 4), (layer, r * 4, 0), w[r * 4:(r + 1) * 4].unsqueeze(0)) for r in range(tp)]


def test_writer_reader_roundtrip_with_layer_and_tp_chunks(tmp_path):
    writer = TorchDistWriter(tmp_path)
    emb = torch.randn(6, 4)
    writer.write_group("embedding", [Chunk("m.e", (6, 4), (0, 0), emb[:3]), Chunk("m.e", (6, 4), (3, 0), emb[3:])])
    for layer in range(3):
        writer.write_group(f"layer.{layer}", _layered_chunks(layer), extra={"n": layer})
    md = writer.finish()
    assert md.state_dict_metadata["m.w"].size == torch.Size([3, 8, 4]) and len(md.state_dict_metadata["m.w"].chunks) == 6
    assert json.loads((tmp_path / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert not (tmp_path / JOURNAL).exists()
    reader = TorchDistReader(tmp_path)
    assert torch.equal(reader.read("m.e"), emb)
    assert torch.equal(reader.read("m.w", 1), torch.arange(32.0).reshape(8, 4) + 100)
    assert reader.read("m.w").shape == (3, 8, 4)


def test_a_chunk_view_stores_only_its_own_bytes(tmp_path):
    big = torch.randn(1000, 100)
    writer = TorchDistWriter(tmp_path)
    writer.write_group("g", [Chunk("m.x", (1000, 100), (0, 0), big[:10]), Chunk("m.x", (1000, 100), (10, 0), big[10:])])
    sizes = [it["length"] for it in writer._records[0]["items"]]
    assert sizes[0] < 10 * 100 * 4 + 2000  # not the 400 kB of the whole storage
    writer.finish()
    assert torch.equal(TorchDistReader(tmp_path).read("m.x"), big)


def test_journal_replay_keeps_intact_groups_and_drops_the_rest(tmp_path):
    writer = TorchDistWriter(tmp_path)
    for layer in range(2):
        writer.write_group(f"layer.{layer}", _layered_chunks(layer), extra={"layer": layer})
    with open(tmp_path / JOURNAL, "a") as j:
        j.write('{"group": "layer.2", "fi')  # the process died while appending
    (tmp_path / "__0_2.distcp.tmp").write_bytes(b"partial")
    again = TorchDistWriter(tmp_path)
    assert again.groups_done() == {"layer.0": {"layer": 0}, "layer.1": {"layer": 1}}
    assert not (tmp_path / "__0_2.distcp.tmp").exists()
    (tmp_path / "__0_1.distcp").write_bytes(b"damaged")  # wrong size: that group and later ones are redone
    assert list(TorchDistWriter(tmp_path).groups_done()) == ["layer.0"]


def test_incomplete_coverage_and_damaged_metadata_are_errors(tmp_path):
    writer = TorchDistWriter(tmp_path / "a")
    writer.write_group("layer.0", _layered_chunks(0))
    with pytest.raises(ValueError, match="chunks cover 32 of 96 elements"):
        writer.finish()
    writer = TorchDistWriter(tmp_path / "b")
    for layer in range(3):
        writer.write_group(f"layer.{layer}", _layered_chunks(layer))
    writer.finish()
    (tmp_path / "b" / ".metadata").write_bytes(pickle.dumps(object())[:5])
    with pytest.raises(FactualityInputError, match="corrupted or truncated"):
        TorchDistReader(tmp_path / "b")
    with pytest.raises(FactualityInputError, match="not a torch_dist checkpoint"):
        TorchDistReader(tmp_path)


class _Payload:
    """What a malicious checkpoint would carry: unpickling it runs a shell command (here: creates a marker file)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def _crafted_checkpoint(tmp_path):
    """A real torch_dist directory whose ``.metadata`` hides a ``__reduce__`` payload in ``planner_data``."""
    writer = TorchDistWriter(tmp_path / "ckpt")
    for layer in range(3):
        writer.write_group(f"layer.{layer}", _layered_chunks(layer))
    metadata = writer.finish()
    marker = tmp_path / "pwned"
    metadata.planner_data = {"innocent": _Payload(marker)}
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    return tmp_path / "ckpt", marker


def test_crafted_metadata_is_refused_without_running_its_code(tmp_path):
    ckpt, marker = _crafted_checkpoint(tmp_path)
    pickle.loads((ckpt / ".metadata").read_bytes())  # plain pickle (the old reader) runs the payload ...
    assert marker.exists()
    marker.unlink()
    with pytest.raises(FactualityInputError, match=r"refusing to unpickle: it refers to posix\.system"):
        TorchDistReader(ckpt)  # ... the allow-list unpickler does not
    assert not marker.exists()


def test_verify_guard_checks_metadata_before_megatrons_plain_pickle(tmp_path):
    from nemo_factuality.convert.torch_dist import untrusted_checkpoint_loading

    ckpt, marker = _crafted_checkpoint(tmp_path)
    with pytest.raises(FactualityInputError, match="refusing to unpickle"):
        with untrusted_checkpoint_loading(ckpt):
            pytest.fail("the guard let a crafted checkpoint through")
    assert not marker.exists()


def test_nemo_to_hf_on_a_crafted_checkpoint_is_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys

    ckpt, marker = _crafted_checkpoint(tmp_path)
    root = tmp_path / "model"
    (root / "model_weights").mkdir(parents=True)
    for f in ckpt.iterdir():
        (root / "model_weights" / f.name).write_bytes(f.read_bytes())
    (root / "model_config.yaml").write_text("mcore_gpt: true\n")
    res = subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "convert", "nemo-to-hf", "--nemo", str(root),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "refusing to unpickle" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()
