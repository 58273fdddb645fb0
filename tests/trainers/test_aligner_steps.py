"""Cluster-scale steps on NeMo-Aligner's Megatron actor (CPU/gloo, in the Aligner venv; ``aligner_driver.py``):
rollout micro batches bucketed by prompt length that end as soon as all their sequences have ended, and at
TP=2 the overlapped reward giving the step the sequential order gives (GRPO, KTO's labeller)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_factuality.testing.aligner_env import run_in_aligner_venv

DRIVER = "tests/trainers/aligner_driver.py"
pytestmark = pytest.mark.slow


def drive(venv: Path, nemo: Path, out: Path, *, nproc: int = 1, timeout: float = 300, **args) -> list[dict]:
    flags = [f"--{k}={v}" for k, v in args.items()]
    res = run_in_aligner_venv(venv, [DRIVER, f"--nemo={nemo}", f"--out={out}", *flags], nproc=nproc, timeout=timeout,
                              preload=True)
    assert res.returncode == 0, res.stdout[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def forward_steps(prompt_lengths: list[int], batch: int, max_new: int, run: dict) -> int:
    """NeMo's generation loop per batch of length-sorted prompts: from the shortest prompt's end, one forward per
    position, until the longest prompt + ``max_new`` or until every sequence has ended (its EOS position)."""
    order = sorted(range(len(prompt_lengths)), key=prompt_lengths.__getitem__)
    total = 0
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        first = min(prompt_lengths[i] for i in rows)
        if all(run["is_end"][i] for i in rows):
            total += max(run["response_lengths"][i] for i in rows) - first
        else:
            total += max(prompt_lengths[i] for i in rows) + max_new - first
    return total


def test_rollout_batches_are_bucketed_by_length_and_end_when_their_sequences_have(venv, stage_policy, tmp_path):
    result = drive(venv, stage_policy, tmp_path, scenario="rollout")[0]
    lengths, batch, max_new = result["prompt_lengths"], result["rollout_micro_batch_size"], result["max_new"]
    assert len(set(lengths)) > 1 and batch < len(lengths)
    given, reversed_, eos = result["given"], result["reversed"], result["eos_model"]
    # rows come back in the order asked for: the reversed prompt list gives the reversed rollouts
    assert reversed_["tokens"][::-1] == given["tokens"] and reversed_["response_lengths"][::-1] == given["response_lengths"]
    # the untrained model runs every batch to max_new new tokens for its longest prompt, in length-sorted batches
    assert given["steps"] == forward_steps(lengths, batch, max_new, given)
    unbucketed = sum(max(lengths[s:s + batch]) + max_new - min(lengths[s:s + batch]) for s in range(0, len(lengths), batch))
    assert given["steps"] < unbucketed
    # the EOS model ends every response after its first token (Aligner's min_length=1 forbids EOS first):
    # each batch stops at its longest prompt + 2, not + max_new
    assert all(eos["is_end"]) and eos["response_lengths"] == [n + 2 for n in lengths]
    assert all(row[n + 1] == result["eos_id"] for row, n in zip(eos["tokens"], lengths, strict=True))
    assert eos["steps"] == forward_steps(lengths, batch, max_new, eos) < given["steps"]


def test_the_overlapped_step_equals_the_sequential_one_at_tp2(venv, stage_policy, tmp_path):
    """GRPO, 2 steps each way from the same weights and seed (rollout micro batches of 3 of the step's 8 samples),
    and KTO's labelling (2 labeller calls): the same rollouts, rewards, advantages, losses and weights. Only the
    model-parallel source rank called the reward, from its worker thread when overlapped; rank 1 got the same
    rewards through the broadcast."""
    ranks = drive(venv, stage_policy, tmp_path, nproc=2, tp=2, scenario="overlap", timeout=420)
    for rank in ranks:
        seq, ovl = rank["grpo_False"], rank["grpo_True"]
        assert seq["seen"] == ovl["seen"] and seq["weight_sum"] == ovl["weight_sum"]
        no_times = [[{k: v for k, v in m.items() if not k.startswith("time/")} for m in run["metrics"]] for run in (seq, ovl)]
        assert no_times[0] == no_times[1]
        assert all(m["time/reward_exposed"] >= 0 for m in ovl["metrics"])
        assert rank["kto_False"]["data"] == rank["kto_True"]["data"] and rank["kto_False"]["stats"] == rank["kto_True"]["stats"]
    r0, r1 = ranks
    assert r0["grpo_False"]["seen"] == r1["grpo_False"]["seen"]
    assert any(a != 0 for step in r0["grpo_True"]["seen"] for row in step["advantages"] for a in row)  # not all-zero
    assert r0["grpo_False"]["calls"] == [["MainThread", 8]] * 2
    assert [n for _, n in r0["grpo_True"]["calls"]] == [3, 3, 2] * 2
    assert all(thread.startswith("reward") for thread, _ in r0["grpo_True"]["calls"] + r0["kto_True"]["calls"])
    assert r1["grpo_False"]["calls"] == r1["grpo_True"]["calls"] == r1["kto_True"]["calls"] == []
    assert r0["kto_True"]["stats"]["kto/dropped_unlabelled"] == 1 and [n for _, n in r0["kto_True"]["calls"]] == [4, 4]
    # the reward's latency was hidden behind generation and log-probs on the source rank
    for m in r0["grpo_True"]["metrics"]:
        assert m["time/reward_exposed"] < m["time/reward"]
