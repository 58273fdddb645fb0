"""``reference.check_initial``: a resumed run finds the initial checkpoint (its reference policy) by fingerprint —
the same files at another path (a container mounting them elsewhere) are accepted with one log line naming both
paths; other files there, or none, are refused in one line."""

from __future__ import annotations

import logging
import shutil

import pytest

from nemo_factuality.trainers.reference import check_initial, initial_record
from nemo_factuality.types import FactualityInputError


@pytest.fixture
def started(tmp_path):
    """A checkpoint directory as a run started from it, and the record its checkpoints keep."""
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "config.json").write_text('{"model_type": "qwen2"}')
    (policy / "model.safetensors").write_bytes(bytes(range(256)) * 1024)
    return policy, initial_record(policy, "model.path")


def test_the_same_files_at_another_path_are_accepted_with_one_line(started, tmp_path, caplog):
    policy, record = started
    mounted = tmp_path / "container" / "models" / "policy"
    shutil.copytree(policy, mounted)  # new path, new mtimes, same content
    caplog.set_level(logging.INFO, logger="nemo_factuality.trainers.reference")
    assert check_initial(record, mounted, tmp_path / "ckpt") == mounted.resolve()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"moved from {policy.resolve()} to {mounted.resolve()}" in lines[0]
    assert "model.path" in lines[0] and "same fingerprint" in lines[0]
    shutil.rmtree(policy)  # the old path need not exist any more
    assert check_initial(record, mounted, tmp_path / "ckpt") == mounted.resolve()


def test_the_same_path_unchanged_is_accepted_silently(started, tmp_path, caplog):
    policy, record = started
    caplog.set_level(logging.INFO, logger="nemo_factuality.trainers.reference")
    assert check_initial(record, policy, tmp_path / "ckpt") == policy.resolve()
    assert not caplog.records


def test_other_files_at_another_path_are_refused(started, tmp_path):
    policy, record = started
    other = tmp_path / "other"
    shutil.copytree(policy, other)
    data = bytearray((other / "model.safetensors").read_bytes())
    data[:8] = b"retrain!"  # the header region: always fingerprinted
    (other / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(FactualityInputError, match=r"now holds another checkpoint \(fingerprint differs\)") as err:
        check_initial(record, other, tmp_path / "ckpt")
    assert "\n" not in str(err.value) and f"model.path={policy.resolve()}" in str(err.value)
    with pytest.raises(FactualityInputError, match=r"model.path=.*/nowhere now does not exist"):
        check_initial(record, tmp_path / "nowhere", tmp_path / "ckpt")


def test_the_same_path_changed_or_gone_is_refused(started, tmp_path):
    policy, record = started
    (policy / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FactualityInputError, match="changed since the run started"):
        check_initial(record, policy, tmp_path / "ckpt")
    shutil.rmtree(policy)
    with pytest.raises(FactualityInputError, match=r"which is missing"):
        check_initial(record, policy, tmp_path / "ckpt")
