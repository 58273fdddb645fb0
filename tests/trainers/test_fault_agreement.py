"""A fault that reaches one data-parallel replica stops every rank alike (issue: the job hung until the NCCL watchdog).

Each replica used to decide "reward server gone" and "preempted" on its own: replica 1 entered the checkpoint's
barrier while replica 0 entered the step's all-reduce, and the job hung — no checkpoint, no exit 75, no requeue.
Here, at TP=2 × DP=2 on the aligner backend (4 ranks, gloo) and at DP=2 on the hf backend (2 ranks, a full
replica each), replica 1's reward client gives up at step 2 while replica 0's answers, and
in another run SIGUSR1 reaches one rank alone: every rank must write the same checkpoint and stop with the
same exit code (75 for the server, 0 after the preemption checkpoint) well within the test's bound, and the rerun
of the same command must end where the undisturbed run ends.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from nemo_factuality.testing.aligner_env import run_in_aligner_venv
from nemo_factuality.testing.servers import convert_checkpoint
from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

pytestmark = pytest.mark.slow
DRIVER = "tests/trainers/fault_agreement_driver.py"


@pytest.fixture(scope="module", params=["aligner-tp2-dp2", "hf-dp2"])
def ranks(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"fault_agreement_{request.param}")
    build_tiny_causal_lm("qwen2", vocab_size=400, out_dir=root / "hf")
    build_tiny_tokenizer(root / "hf")
    out = root / "out"
    out.mkdir()
    if request.param.startswith("aligner"):
        venv = request.getfixturevalue("venv")
        convert_checkpoint("hf-to-nemo", "--hf", str(root / "hf"), "--out", str(root / "policy"), "--extracted")
        # a group timeout with room for a NeMo checkpoint's forked writer on a loaded 2-core machine
        args, nproc = [f"--nemo={root / 'policy'}", "--tp=2", "--group-timeout=90"], 4
    else:  # the project's own venv: a full replica per rank; the tight timeout, and the probe that it holds
        venv, args, nproc = Path(sys.executable).parents[1], [f"--hf={root / 'hf'}", "--probe-timeout"], 2
    # bounded: before the fix this run hung in mismatched collectives until killed here. 480 s leaves the fixture's
    # checkpoint conversion room under pytest's 600 s, so this bound (which kills the run's process group) fires first
    res = run_in_aligner_venv(venv, [DRIVER, f"--out={out}", *args], nproc=nproc, timeout=480)
    assert res.returncode == 0, res.stdout[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_layout_is_two_replicas(ranks):
    per_replica = len(ranks) // 2  # TP=2 on the aligner backend, one rank per replica on hf
    assert sorted(r["dp_rank"] for r in ranks) == [0] * per_replica + [1] * per_replica


def test_one_replicas_server_gone_stops_every_rank_with_a_checkpoint_and_exit_75(ranks):
    for r in ranks:
        outage = r["runs"]["outage"]
        assert outage["exit"] == 75, (r["rank"], outage["exit"])
        # step 1 finished and checkpointed; step 2 abandoned before any update: its start is the checkpoint
        assert outage["checkpoints"][-1] == "step_000001" and "latest" in outage["checkpoints"], outage["checkpoints"]
        assert not any(c.endswith(".partial") for c in outage["checkpoints"])
    # only replica 1's source rank saw the fault; the others were told, not timed out
    assert {r["runs"]["outage"]["calls"] for r in ranks if r["dp_rank"] == 0 and r["runs"]["outage"]["calls"]} == {2}


def test_one_replicas_engine_gone_stops_every_rank_with_a_checkpoint_and_exit_75(ranks):
    """Issue 39: generation ran outside the stage's agreement, so replica 1 went to the checkpoint's barrier while
    replica 0 entered the step's all-reduce. Now every rank checkpoints step 1 and exits 75."""
    for r in ranks:
        engine = r["runs"]["engine"]
        assert engine["exit"] == 75, (r["rank"], engine["exit"])
        assert engine["checkpoints"][-1] == "step_000001" and "latest" in engine["checkpoints"], engine["checkpoints"]


def test_the_default_group_times_out_at_trainer_distributed_timeout_s(ranks):
    """Issue 39: every process group gets the config's timeout. Before, the groups had torch's default (gloo 30 min,
    NCCL 10 min), and rank 0 waited here until the run's bound killed it."""
    if "timeout_probe" not in ranks[0]:
        pytest.skip("probed on the hf backend (the aligner run's group timeout leaves a loaded machine room)")
    probe, timeout = ranks[0]["timeout_probe"], ranks[0]["group_timeout_s"]
    assert probe["error"] is not None, probe
    assert timeout - 1 <= probe["waited_s"] <= timeout + 10, probe


def test_the_healthy_replicas_waited_out_the_faulty_ones_window_without_timing_out(ranks):
    """The outage run's faulty replica spent its whole retry window (scaled down, inside the group's timeout) before
    reporting; the healthy ranks waited for it in the step's agreement and got its verdict, not a timeout."""
    for r in ranks:
        assert r["runs"]["outage"]["seconds"] >= r["max_wait_s"], (r["rank"], r["runs"]["outage"]["seconds"])
        assert r["runs"]["outage"]["exit"] == 75


def test_preemption_on_one_rank_checkpoints_every_rank_at_the_same_step(ranks):
    for r in ranks:
        preempt = r["runs"]["preempt"]
        assert preempt["exit"] == 0, (r["rank"], preempt)
        assert preempt["checkpoints"][-1] == "step_000002", preempt["checkpoints"]
        assert len(preempt["metrics"]) == 2  # the writer logged steps 1 and 2 (every rank reads its file)


@pytest.mark.parametrize("name", ["outage", "preempt", "engine"])
def test_the_rerun_equals_the_undisturbed_run(ranks, name):
    if name == "engine" and len(ranks) == 4:
        # found with this test (issue 39, item 3): on the aligner backend the rerun after one replica's engine was
        # lost reaches the same rewards at every step but not the same final weights; the hf backend's is exact
        pytest.xfail("aligner: the engine-outage rerun's final weights differ from the undisturbed run's (open)")
    for r in ranks:
        undisturbed, resumed = r["runs"]["undisturbed"], r["runs"][f"{name}_resumed"]
        assert resumed["exit"] == 0 and resumed["checkpoints"][-1] == "step_000003"
        assert resumed["logprobs"] == undisturbed["logprobs"], r["rank"]  # the same weights, exactly
    writer = ranks[0]["runs"]
    scores = lambda run: [(m["step"], m["reward/score"]) for m in run["metrics"]]  # noqa: E731
    assert scores(writer[f"{name}_resumed"])[-3:] == scores(writer["undisturbed"])
