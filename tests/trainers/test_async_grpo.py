"""Async GRPO and PPO (issue 53: ``<stage>.max_staleness``): the next step's rollouts generate on the engine while this
step trains, on ``testing.scripted_engine`` — the real engine program's channel and request loop, with generation a
hand-checkable function of the prompt, the sample's seed and the weight version the engine holds.

* k = 0 is today's step: the engine gets exactly the requests the loop sent before ``max_staleness`` existed (recorded
  from that code: ``tests/data/async_grpo/k0_engine_requests.json``), the step logs the same metric names, and the
  async machinery is never built.
* k = 1 and 2, by hand: which weights generated each step's rollouts (their tokens), which refits the engine got, the
  logged staleness, and the engine generating step n + 1's rollouts while step n trains.
* Faults: a run preempted with rollouts in flight resumes to the undisturbed run (nothing lost, nothing repeated); an
  engine gone mid-flight past its restarts checkpoints and exits 75, and the rerun regenerates the lost rollouts from
  the resumed weights; an engine restarted mid-flight (file: refit from the file, same version; broadcast: streamed
  to again, the rest generated with the current weights) finishes the run.
* PPO at k = 1; the settings k >= 1 needs, and KTO's refusal, each one line.

The data-parallel case (an engine gone on one replica: every rank checkpoints and exits 75) is
``test_async_fault_agreement.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from nemo_factuality.config import ConfigError
from nemo_factuality.testing.scripted_engine import engine_python, events, klcf_stage_argv, scripted_tokens
from nemo_factuality.testing.training import (
    good_fraction,
    good_tokens_dense,
    grpo_test_config,
    prompts,
    read_metrics,
    set_dotted,
)
from nemo_factuality.trainers import grpo as grpo_module
from nemo_factuality.trainers.backends.hf.actor import HFActor, HFCritic
from nemo_factuality.trainers.config import GRPOConfig, KTOConfig, PPOConfig, validate_train_config
from nemo_factuality.trainers.engines.vllm_rollout import with_rollout_engine
from nemo_factuality.trainers.grpo import GRPOTrainer
from nemo_factuality.trainers.ppo import PPOTrainer

pytestmark = pytest.mark.slow
GOLDEN = Path(__file__).resolve().parents[1] / "data" / "async_grpo" / "k0_engine_requests.json"
TOKENS = 6  # model.length_params.max_length


class Recording:
    """Mixin: each step's trained rollout, its prompt rows, and when the trainer computed on it — from its log-probs to
    the end of its update (wall clock, as the engine logs its requests)."""

    def _logprobs(self, rollout):
        self._computing = time.time()
        return super()._logprobs(rollout)

    def _update(self, experience):
        out = super()._update(experience)
        self.seen = getattr(self, "seen", [])
        self.seen.append({"tokens": experience["tokens"].clone(), "prompts": list(self.step_prompts),
                          "train": (self._computing, time.time())})
        return out


class RecordingGRPO(Recording, GRPOTrainer):
    pass


class RecordingPPO(Recording, PPOTrainer):
    pass


def scripted_run(tmp_path: Path, policy: Path, *, k: int, steps: int = 3, script: dict | None = None,
                 reward=good_fraction, stage: str = "grpo", **over):
    """A GRPO (or PPO) run on the hf backend with rollouts on the scripted engine (``steps`` steps, 4 prompts × 8
    samples in 2 requests of 16 a step); (trainer, history, the engine's events). A second call with the same
    ``tmp_path`` resumes the run."""
    run = tmp_path / "run"
    over = {"rollout.engine": "vllm", "rollout.vllm.python": str(engine_python(tmp_path / "engine", script or {})),
            "rollout.vllm.start_timeout_s": 60, "rollout.vllm.request_timeout_s": 20,
            "rollout.vllm.reply_timeout_s": 5, "model.rollout_micro_batch_size": 16, "rollout.vllm.tis_cap": 2.0,
            f"{stage}.max_staleness": k, "rollout.vllm.placement": "separate" if k else "colocated", **over}
    if stage == "grpo":
        cfg = grpo_test_config(policy, run, steps=steps, **over)
    else:
        cfg = PPOConfig()
        set_dotted(cfg, {"model.path": str(policy), "model.length_params.max_length": TOKENS, "trainer.max_steps": steps,
                         "trainer.progress_bar": False, "trainer.save_interval": 0, "exp_manager.explicit_log_dir": str(run),
                         "exp_manager.create_tensorboard_logger": False, "model.global_batch_size": 8,
                         "model.micro_batch_size": 4, "ppo.num_prompts_per_step": 8, "critic.micro_batch_size": 4,
                         "model.optim.lr": 3e-3, **over})
    cfg.remote_rm.url = "http://127.0.0.1:9"  # the start-up checks want a reward; the run is given one in-process
    validate_train_config(cfg)
    torch.manual_seed(0)
    actor = with_rollout_engine(cfg, HFActor(cfg.model, max_steps=10), run)
    try:
        if stage == "grpo":
            trainer = RecordingGRPO(cfg, actor, reward, prompts(8), run_dir=run)
        else:
            trainer = RecordingPPO(cfg, actor, HFCritic(cfg.critic, cfg.model.path, max_steps=10), reward, prompts(8),
                                   run_dir=run)
        torch.manual_seed(0)
        history = trainer.fit()
    finally:
        actor.close()
    return trainer, history, events(run / "vllm" / "rank0")


def requests(seen: list[dict], op: str | None = None) -> list[dict]:
    return [e for e in seen if e["event"] == "request" and (op is None or e["op"] == op)]


def k0_run(tmp_path: Path, policy: Path) -> tuple[list[dict], list[list[str]]]:
    """The k = 0 run the golden records: the engine's requests (without clocks and folders) and each step's metric
    names."""
    _, history, seen = scripted_run(tmp_path, policy, k=0, steps=3)
    out = []
    for e in requests(seen):
        e = {key: v for key, v in e.items() if key not in ("event", "t0", "t1", "start")}
        if "path" in e:
            e["path"] = Path(e["path"]).name
        out.append(e)
    return out, [sorted(h) for h in history]


def test_at_max_staleness_0_the_engine_gets_todays_requests_and_the_step_logs_todays_metrics(tiny_policy, tmp_path,
                                                                                            monkeypatch):
    """The on-policy step is unchanged: the same requests in the same order (prompts, per-request seeds drawn from the
    trainer's stream, sampling, refits — none naming a weight version), the same metric names, and the async
    machinery never built (it raises here if it is). Checked once by hand besides: a 4-step run's metrics and final
    weights equal, bit for bit, those of the code before the change."""
    class NotAtK0:
        def __init__(self, *_):
            raise AssertionError("the async machinery was built at max_staleness=0")

    monkeypatch.setattr(grpo_module, "RolloutsAhead", NotAtK0)
    got, keys = k0_run(tmp_path, tiny_policy)
    golden = json.loads(GOLDEN.read_text())
    assert [r["op"] for r in got] == ["health"] + ["generate", "generate", "refit"] * 2 + ["generate", "generate"]
    assert got == golden["requests"]
    assert all(k == golden["metric_keys"] for k in keys)


@pytest.mark.parametrize("k, versions, refits", [(1, [0, 0, 1, 2], [1, 2]), (2, [0, 0, 0, 2, 2], [2])])
def test_each_step_trains_on_rollouts_of_weights_at_most_k_updates_old_by_hand(tiny_policy, tmp_path, k, versions,
                                                                                refits):
    """Step n trains with the weights after step n − 1. At k = 1 the engine is refit with them before every launch
    from step 2 on, so step n + 1's rollouts come from the weights after step n − 1 (version n − 1): versions
    0, 0, 1, 2, staleness 0, 1, 1, 1. At k = 2 it is refit only when the next rollouts would be more than 2 updates
    old: step 4's launch (during step 3) finds the engine at version 0, 3 − 0 > 2, so it refits version 2: versions
    0, 0, 0, 2, 2, staleness 0, 1, 2, 1, 2. Each trained rollout is the scripted engine's function of its prompt,
    its seed and that version, token for token."""
    trainer, history, seen = scripted_run(tmp_path, tiny_policy, k=k, steps=len(versions),
                                          script={"starts": {"0": {"generate_s": 0.3}}})
    assert [m["rollout/staleness"] for m in history] == [s - v for s, v in enumerate(versions)]
    assert [r["version"] for r in requests(seen, "refit")] == refits
    generated = requests(seen, "generate")
    assert [g["version"] for g in generated] == [v for v in versions for _ in range(2)]  # two requests a step
    vocab = trainer.actor.model.config.vocab_size
    for step, (record, version) in enumerate(zip(trainer.seen, versions, strict=True)):
        want = []
        for g in generated[2 * step : 2 * step + 2]:
            for row, prompt in enumerate(g["prompts"]):
                want.append(prompt + scripted_tokens(prompt, g["seed"] + row, TOKENS, version, vocab))
        assert record["tokens"].tolist() == want, step
        asked = [p for g in generated[2 * step : 2 * step + 2] for p in g["prompts"]]
        assert asked == [trainer.prompt_ids[i] for i in record["prompts"] for _ in range(8)]
    # the engine generated step n + 1's rollouts while step n computed (log-probs, update), and was refit only after
    # the update whose weights it loads
    for step in range(len(versions) - 1):
        start, end = trainer.seen[step]["train"]
        nxt = generated[2 * step + 2 : 2 * step + 4]
        assert nxt[0]["t0"] < end and nxt[-1]["t1"] > start, (step, start, end, nxt[0]["t0"], nxt[-1]["t1"])
    for refit in requests(seen, "refit"):
        assert refit["t0"] > trainer.seen[refit["version"] - 1]["train"][1]
    assert all(m["rollout/tis_weight_mean"] > 0 and 0 <= m["rollout/tis_clipped_frac"] <= 1 for m in history)
    idle = [m["time/engine_idle"] for m in history]
    assert all(x >= 0 for x in idle[:-1]) and math.isnan(idle[-1])  # the last step launches nothing


@pytest.fixture(scope="module")
def judge():
    from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer
    from nemo_factuality.testing.methods import method_judge

    with ScriptedOpenAIServer(method_judge) as server:
        yield server


def _preempt_at(call: int):
    """``good_fraction``, sending this process SIGUSR1 at its ``call``-th call (the reward worker's thread: the
    signal lands in the main thread, which checkpoints at the end of the step)."""
    calls = []

    def reward(prompts_, completions, **columns):
        calls.append(len(completions))
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGUSR1)
        return good_fraction(prompts_, completions, **columns)
    return reward


def _no_times(history):
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in history]


def test_a_run_preempted_with_rollouts_in_flight_resumes_to_the_undisturbed_run(tiny_policy, tmp_path):
    """SIGUSR1 during step 1 (its reward's first call), while step 2's rollouts are in flight: the checkpoint
    after step 1 waits for them and saves them; the rerun trains on exactly those (none lost, none repeated) and
    ends where the undisturbed run ends — the same metrics, rollouts and weights. Before the checkpoint saved them
    (checked by hand: ``RolloutsAhead.load`` a no-op) the rerun's step 2 trained step 3's prompts."""
    plain, plain_history, _ = scripted_run(tmp_path / "plain", tiny_policy, k=1, steps=4)
    first, first_history, _ = scripted_run(tmp_path / "preempted", tiny_policy, k=1, steps=4, reward=_preempt_at(1))
    assert len(first_history) == 1
    saved = torch.load(tmp_path / "preempted" / "run" / "checkpoints" / "step_000001" / "rollouts_ahead.pt",
                       weights_only=True)
    assert saved["ranks"][0]["step"] == 2 and len(saved["ranks"][0]["chunks"]) == 2
    resumed, resumed_history, seen = scripted_run(tmp_path / "preempted", tiny_policy, k=1, steps=4)
    assert _no_times(first_history + resumed_history) == _no_times(plain_history)
    assert [s["prompts"] for s in first.seen + resumed.seen] == [s["prompts"] for s in plain.seen]
    for a, b in zip(first.seen + resumed.seen, plain.seen, strict=True):
        assert torch.equal(a["tokens"], b["tokens"])
    for p, q in zip(resumed.actor.model.parameters(), plain.actor.model.parameters(), strict=True):
        assert torch.equal(p, q)
    # the resumed engine starts from model.path: refit with the weights after step 1 before step 3's rollouts
    assert [r["version"] for r in requests(seen, "refit")] == [1, 2]


def test_an_engine_gone_mid_flight_checkpoints_and_exits_75_then_the_rerun_regenerates_what_was_lost(tiny_policy,
                                                                                                    tmp_path, judge,
                                                                                                    capfd):
    """``nemo-factuality train grpo`` (KLCF's tiny preset, one engine request a step) at k = 1: the engine dies at its
    3rd request (step 3's, sent while step 2 trains) with no restart left; step 3 takes the failure, checkpoints step
    2 and exits 75. The rerun regenerates step 3's rollouts with the seeds drawn for them, from the resumed weights
    (version 2: staleness 0), then goes on one step ahead."""
    from nemo_factuality.cli import main as cli_main

    argv, run = klcf_stage_argv(tmp_path, judge.url, tiny_policy, max_steps=4)
    argv += ["rollout.vllm.placement=separate", "rollout.vllm.tis_cap=2.0", "grpo.max_staleness=1",
             "rollout.vllm.restarts=0"]
    dying = engine_python(tmp_path / "engine", {"starts": {"0": {"die_at_generate": 3}}})
    assert cli_main([*argv, f"rollout.vllm.python={dying}"]) == 75
    err = capfd.readouterr().err
    assert "rollout.vllm.restarts=0 restarts are used up" in err and "checkpoint step_000002 written" in err, err[-3000:]
    assert [m["step"] for m in read_metrics(run)] == [1, 2]
    assert cli_main([*argv, f"rollout.vllm.python={engine_python(tmp_path / 'again', {})}"]) == 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["rollout/staleness"] for m in metrics] == [0, 1, 0, 1]  # step 3 regenerated from the resumed weights


@pytest.mark.parametrize("refit", ["file", "broadcast"])
def test_an_engine_restarted_mid_flight_finishes_the_run(tiny_policy, tmp_path, refit):
    """The engine dies at its 5th request (step 3's first, in flight while step 2 trains), one restart left. By file
    the flight restarts it and refits it from the file with the version it held (1): the run is the undisturbed
    schedule. By broadcast the restarted engine holds model.path's weights until streamed to, which only the
    trainer's thread can do: the flight ends early and step 3 streams the current weights (version 2) and generates
    its rollouts with them (staleness 0)."""
    _, history, seen = scripted_run(tmp_path, tiny_policy, k=1, steps=4, **{"rollout.vllm.refit": refit,
                                                                          "rollout.vllm.restarts": 1},
                                    script={"starts": {"0": {"die_at_generate": 5}}})
    starts = [e for e in seen if e["event"] == "start"]
    assert len(starts) == 2 and len(history) == 4
    gens = [(g["start"], g["version"]) for g in requests(seen, "generate")]
    if refit == "file":
        assert [m["rollout/staleness"] for m in history] == [0, 1, 1, 1]
        assert [(r["start"], r["version"]) for r in requests(seen, "refit")] == [(0, 1), (1, 1), (1, 2)]
        assert gens[4:6] == [(1, 1), (1, 1)]
    else:
        assert [m["rollout/staleness"] for m in history] == [0, 1, 0, 1]
        assert [(r["start"], r["version"]) for r in requests(seen, "refit_stream")] == [(0, 1), (1, 2)]
        assert gens[4:6] == [(1, 2), (1, 2)]


def test_ppo_at_max_staleness_1_trains_on_rollouts_one_update_old(tiny_policy, tmp_path):
    """PPO runs the same loop: the critic's values, GAE and the KL in the token rewards are computed at train time
    by the trainer's models, so the only off-policy part is the engine's sampling, which the truncated importance
    weights correct."""
    _, history, seen = scripted_run(tmp_path, tiny_policy, k=1, steps=3, stage="ppo", reward=good_tokens_dense)
    assert [m["rollout/staleness"] for m in history] == [0, 1, 1]
    assert [r["version"] for r in requests(seen, "refit")] == [1]
    assert all(math.isfinite(m["loss/policy"]) and math.isfinite(m["loss/value"]) for m in history)


@pytest.mark.parametrize("over, named", [
    ({"rollout.engine": "megatron"}, "grpo.max_staleness=1 needs rollout.engine=vllm"),
    ({"rollout.vllm.tis_cap": None}, "set rollout.vllm.tis_cap (e.g. 2.0), the truncated importance weight"),
    ({"grpo.max_staleness": -1}, "grpo.max_staleness must be >= 0, got -1"),
])
def test_what_max_staleness_needs_is_refused_naming_the_setting(over, named):
    cfg = GRPOConfig()
    set_dotted(cfg, {"model.path": "/m", "remote_rm.url": "http://rm:5555", "rollout.engine": "vllm", "grpo.max_staleness": 1,
                     "rollout.vllm.placement": "separate", "rollout.vllm.tis_cap": 2.0, **over})
    with pytest.raises(ConfigError, match="invalid training config") as err:
        validate_train_config(cfg)
    assert named in str(err.value)


def test_a_colocated_engine_is_allowed_at_max_staleness_1():
    """Unlike NeMo-RL's vLLM async GRPO (its colocated engine sleeps while the policy trains), ours stays resident, so a
    colocated one can generate meanwhile, on the shared GPU (a warning says so there); it is not refused."""
    cfg = GRPOConfig()
    set_dotted(cfg, {"model.path": "/m", "remote_rm.url": "http://rm:5555", "rollout.engine": "vllm",
                     "grpo.max_staleness": 1, "rollout.vllm.placement": "colocated", "rollout.vllm.tis_cap": 2.0})
    validate_train_config(cfg)


def test_kto_refuses_max_staleness_in_one_line(tmp_path, capsys):
    cfg = KTOConfig()
    set_dotted(cfg, {"model.path": "/m", "remote_rm.url": "http://rm:5555", "kto.max_staleness": 1})
    with pytest.raises(ConfigError, match="kto.max_staleness=1: KTO samples each iteration from its starting policy"):
        validate_train_config(cfg)
    from nemo_factuality.cli import main as cli_main

    assert cli_main(["train", "kto", "--config-name", "tiny_cpu_factalign", "kto.max_staleness=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kto.max_staleness=1" in err[0] and "Traceback" not in err[0], err
