"""Checkpoints at scale on the aligner backend (NeMo-Aligner's actor on CPU/gloo, in the Aligner venv).

The GRPO/PPO reference is the initial ``.nemo``: a checkpoint records its path and fingerprint instead of a copy;
KTO's (after ``reset_reference``) is stored once as a Megatron distributed checkpoint, sharded like the policy.
Saved at world 1 (``ckpt_save``): both kinds. Saved at DP=2: no more bytes than at world 1 (each rank used to add
its own reference copy). Loaded at TP=2 (``ckpt_load``): the policy's and both references' log-probs equal the
ones at save time, training goes on, and asking a process whose reference moved for the initial one is refused
in one line. The reference is never silently ``None``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_factuality.testing.aligner_env import run_in_aligner_venv

DRIVER = "tests/trainers/aligner_driver.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _drive(venv: Path, nemo: Path, out: Path, *, nproc: int, **args) -> list[dict]:
    flags = [f"--{k}={v}" for k, v in args.items()]
    res = run_in_aligner_venv(venv, [DRIVER, f"--nemo={nemo}", f"--out={out}", *flags], nproc=nproc, timeout=400,
                              preload=True)
    assert res.returncode == 0, res.stdout[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def saved_world1(venv, stage_policy, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt_world1")
    return out, _drive(venv, stage_policy, out, nproc=1, scenario="ckpt_save")[0]


def _actions(probe: dict, key: str) -> list[float]:
    return [v for row, p, r in zip(probe[key], probe["prompt_lengths"], probe["response_lengths"], strict=True)
            for v in row[p - 1 : r - 1]]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_initial_reference_is_recorded_not_copied_and_kto_s_is_stored_once(saved_world1, stage_policy):
    out, world1 = saved_world1
    record = json.loads((out / "initial_ref" / "reference.json").read_text())
    assert record["kind"] == "initial" and Path(record["path"]) == Path(stage_policy).resolve()
    assert len(record["fingerprint"]) == 64 and record["key"] == "model.restore_from_path"
    assert world1["initial_ref"]["files"] == ["reference.json", "state"]
    assert world1["stored_ref"]["files"] == ["reference", "reference.json", "state"]
    assert not list(out.rglob("reference.rank*.pt"))
    # the stored reference is about the size of the bf16/fp32 weights inside the state: less than the state itself
    assert 0 < world1["stored_ref"]["bytes"] - world1["initial_ref"]["bytes"] < world1["initial_ref"]["bytes"]


def test_a_checkpoint_written_at_dp2_holds_no_more_bytes_than_at_world_1(venv, stage_policy, saved_world1, tmp_path):
    _, world1 = saved_world1
    r0, r1 = _drive(venv, stage_policy, tmp_path, nproc=2, scenario="ckpt_save")
    for name in ("initial_ref", "stored_ref"):
        assert r0[name]["bytes"] == r1[name]["bytes"]  # one directory, measured from both ranks
        # Megatron deduplicates data-parallel replicas; per-rank metadata may add a few hundred bytes, never a copy
        print(f"{name}: world 1 {world1[name]['bytes']} B, DP=2 {r0[name]['bytes']} B")
        assert r0[name]["bytes"] <= world1[name]["bytes"] + 4096, (name, r0[name]["bytes"], world1[name]["bytes"])


def test_saved_at_tp1_resumes_at_tp2_with_both_references(venv, stage_policy, saved_world1, tmp_path):
    ckpt, world1 = saved_world1
    r0, r1 = _drive(venv, stage_policy, tmp_path, nproc=2, tp=2, scenario="ckpt_load", ckpt=ckpt)
    for rank in (r0, r1):
        for name in ("initial_ref", "stored_ref"):
            saved, loaded = world1[name], rank[name]
            assert _max_diff(_actions(saved, "lp"), _actions(loaded, "lp")) < 1e-4, name
            assert _max_diff(_actions(saved, "ref"), _actions(loaded, "ref")) < 1e-4, name
            assert rank[name]["step"]["grad_norm"] > 0  # training goes on with the restored optimiser
        # KTO's stored reference is the trained policy of its save, not the initial one (nor None)
        assert _max_diff(_actions(rank["stored_ref"], "ref"), _actions(rank["initial_ref"], "ref")) > 1e-3
        assert "reset its reference" in rank["refused"] and "\n" not in rank["refused"]
