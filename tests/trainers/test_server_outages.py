"""Long runs survive a reward server that goes away (hf backend, the real ``nemo-factuality serve`` process).

One served RLFH reward whose LLM judge is a loopback OpenAI-protocol server with scripted, response-dependent
verdicts (so rewards, advantages and updates are not constant). Three GRPO runs of 3 steps on the same data:

* undisturbed;
* the server SIGKILLed while a request is in flight (the judge holds it), restarted on the same ports: the
  client waits, retries the same request, and the run's metrics and final weights equal the undisturbed run's;
* the server killed and left down past ``remote_rm.retry.max_wait_s``: checkpoint of the step's start, one
  stderr line, exit 75; the rerun (server back) finishes and equals the undisturbed run.

And on the aligner backend at TP=2 (torchrun, 2 processes, NeMo-Aligner's actor on gloo): the GRPO stage twice
from the same weights, the second with the server killed mid-request and restarted; the model-parallel source
rank waits and resends while the other rank waits in the broadcast; both runs log the same metrics.
"""

from __future__ import annotations

import math
import threading
import time
import zlib
from contextlib import ExitStack
from pathlib import Path

import pytest

from nemo_factuality.testing.aligner_env import run_in_aligner_venv
from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.testing.ports import free_ports
from nemo_factuality.testing.servers import SERVE_PORT_KEYS, kill_group, reward_server
from nemo_factuality.testing.training import read_metrics, write_jsonl

pytest.importorskip("pytriton")

HOLD = {"armed": None, "delay_s": 4.0}  # an Event: the next verification request sets it and is answered late


def _judge(req: dict) -> Reply:
    content = req["messages"][-1]["content"]
    if "atomic statements" in content:  # RLFH extraction: one statement per response
        resp = " ".join(content.split("Response:")[-1].split())[:60] or "nothing"
        return Reply(f">> Sentence 1: {resp}.\n* {resp}.")
    if "Choose from" in content:  # the verdict depends on the statement: rewards differ between samples
        armed, HOLD["armed"] = HOLD["armed"], None
        if armed is not None:
            armed.set()
            return Reply("Correct", delay_s=HOLD["delay_s"])
        statement = content.split("Statement:")[-1]
        return Reply("Correct" if zlib.crc32(statement.encode()) % 3 else "Wrong")
    return Reply("3")


@pytest.fixture(scope="module")
def outage_env(tmp_path_factory, tiny_policy):
    root = tmp_path_factory.mktemp("outages")
    data = write_jsonl(root / "train.jsonl", [{"question": f"When was Ada Varga born ({i})?", "titles": ["Ada Varga"],
                                               "materials": ["Ada Varga was born in 1917 in Pécs."], "extra_materials": []}
                                              for i in range(4)])
    with ScriptedOpenAIServer(_judge) as judge:
        yield {"root": root, "data": data, "judge": judge, "policy": tiny_policy,
               "ports": dict(zip(SERVE_PORT_KEYS, free_ports(len(SERVE_PORT_KEYS)), strict=True))}


def _serve(env: dict, stack: ExitStack, name: str) -> dict:
    overrides = [f"reward.judge.base_url={env['judge'].url}", "reward.judge.concurrency=4", f"policy_tokenizer={env['policy']}",
                 "reward.judge.timeout_s=30"]
    server = stack.enter_context(reward_server("rlfh", overrides, env["root"] / name, {}, ports=list(env["ports"].values())))
    server["wait_ready"]()
    return server


def _kill(server: dict) -> None:
    assert not kill_group(server["proc"])  # a crash: Triton, its stubs and their shared memory gone


def _args(env: dict, run_dir: Path, max_wait_s: float) -> list[str]:
    return ["train", "grpo", "--config-name", "tiny_cpu_klcf", f"model.path={env['policy']}",
            f"exp_manager.explicit_log_dir={run_dir}", "exp_manager.create_tensorboard_logger=false",
            "model.length_params.max_length=8", "reward=null", f"remote_rm.url=http://127.0.0.1:{env['ports']['http_port']}",
            "remote_rm.init_timeout_s=2", "remote_rm.timeout_s=20", f"remote_rm.retry.max_wait_s={max_wait_s}",
            "remote_rm.retry.initial_s=0.5", "remote_rm.retry.max_s=2", "data.format=rlfh", f"data.train={env['data']}"]


def _run(args: list[str]) -> int:
    from nemo_factuality.cli import main as cli

    return cli(args)


def _comparable(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in read_metrics(run_dir)]


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "model.safetensors"))


def _assert_same_run(run_dir: Path, reference: Path) -> None:
    import torch

    assert _comparable(run_dir) == _comparable(reference)
    a, b = _weights(run_dir), _weights(reference)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def undisturbed(outage_env):
    run_dir = outage_env["root"] / "undisturbed"
    with ExitStack() as stack:
        _serve(outage_env, stack, "serve0")
        assert _run(_args(outage_env, run_dir, 60)) == 0
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    # the verdicts differ between samples, so every step has non-zero advantages and moves the weights
    assert all(m["advantage/abs_mean"] > 0 and math.isfinite(m["loss/policy"]) for m in metrics)
    return run_dir


@pytest.mark.slow
def test_server_killed_with_a_request_in_flight_and_restarted_loses_no_step(outage_env, undisturbed, caplog):
    run_dir = outage_env["root"] / "restarted"
    url = f"http://127.0.0.1:{outage_env['ports']['http_port']}"
    events: dict[str, float] = {}

    def kill_in_flight_then_restart(server: dict, stack: ExitStack) -> None:
        while not (run_dir / "metrics.jsonl").exists():  # step 1 done; step 2's verification gets held
            time.sleep(0.05)
        in_flight = threading.Event()
        HOLD["armed"] = in_flight
        assert in_flight.wait(120), "no verification request reached the judge"
        _kill(server)  # the trainer's request is open on the server: the connection drops
        events["killed"] = time.monotonic()
        time.sleep(2.0)  # refused connections meanwhile
        _serve(outage_env, stack, "serve_again")
        events["back"] = time.monotonic()

    with ExitStack() as stack:
        server = _serve(outage_env, stack, "serve1")
        chaos = threading.Thread(target=kill_in_flight_then_restart, args=(server, stack), daemon=True)
        chaos.start()
        with caplog.at_level("WARNING", logger="nemo_factuality.serving.client"):
            assert _run(_args(outage_env, run_dir, 120)) == 0
        chaos.join(timeout=60)
    assert "killed" in events and "back" in events
    waits = [r.getMessage() for r in caplog.records if "retrying the same request" in r.getMessage()]
    assert waits and all(url in w for w in waits)
    _assert_same_run(run_dir, undisturbed)


@pytest.mark.slow
def test_server_down_past_the_window_checkpoints_exits_75_in_one_line_and_the_rerun_equals(outage_env, undisturbed,
                                                                                          capsys):
    run_dir = outage_env["root"] / "gone"
    with ExitStack() as stack:
        server = _serve(outage_env, stack, "serve2")

        def kill_after_step_1() -> None:
            while not (run_dir / "metrics.jsonl").exists():
                time.sleep(0.05)
            _kill(server)

        threading.Thread(target=kill_after_step_1, daemon=True).start()
        capsys.readouterr()
        t0 = time.monotonic()
        assert _run(_args(outage_env, run_dir, 3)) == 75
        assert time.monotonic() - t0 < 90
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "error" in ln.lower()]  # (stderr also has transformers' load bar)
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("nemo-factuality train: error: reward server http://127.0.0.1:") and "(exit 75)" in lines[0]
    assert "remote_rm.retry.max_wait_s=3" in lines[0] and "checkpoint step_000001 written" in lines[0]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000001"
    assert [m["step"] for m in read_metrics(run_dir)] == [1]
    # the marker the Slurm launcher requeues on (besides exit 75), holding the same line
    assert (run_dir / "REQUEUE").read_text().strip() in lines[0]
    (run_dir / "REQUEUE").unlink()  # the launcher removes it before requeueing
    with ExitStack() as stack:  # the requeued job, the server back
        _serve(outage_env, stack, "serve3")
        assert _run(_args(outage_env, run_dir, 3)) == 0
    _assert_same_run(run_dir, undisturbed)


def _disturb(server: dict, stack: ExitStack, env: dict, watch: Path, events: dict) -> None:
    """Once ``watch`` exists (the run's step 1 is logged), hold the next verification request at the judge, kill the
    server while it is in flight, and start it again on the same ports."""
    deadline = time.monotonic() + 600
    while not watch.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    in_flight = threading.Event()
    HOLD["armed"] = in_flight
    if not in_flight.wait(300):
        return
    _kill(server)
    events["killed"] = time.monotonic()
    time.sleep(2.0)
    _serve(env, stack, f"serve_{watch.parent.name}")
    events["back"] = time.monotonic()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_aligner_backend_at_tp2_survives_a_reward_server_restart(outage_env, stage_policy, venv):
    import json

    out = outage_env["root"] / "aligner_tp2"
    url = f"http://127.0.0.1:{outage_env['ports']['http_port']}"
    common = [f"model.restore_from_path={stage_policy}", "trainer.backend=aligner", "trainer.max_steps=2",
              "trainer.save_interval=0", "trainer.progress_bar=false", "model.tensor_model_parallel_size=2",
              "grpo.num_prompts_per_step=2", "grpo.num_rollouts_per_prompt=2", "model.micro_batch_size=2",
              "model.global_batch_size=4", "model.forward_micro_batch_size=4", "model.length_params.max_length=6",
              "model.dtype=float32", "model.optim.name=sgd", "model.optim.lr=0.05", "model.optim.sched.name=constant",
              "exp_manager.create_tensorboard_logger=false", "reward=null", f"remote_rm.url={url}",
              "remote_rm.init_timeout_s=2", "remote_rm.timeout_s=20", "remote_rm.retry.max_wait_s=120",
              "remote_rm.retry.initial_s=0.5", "remote_rm.retry.max_s=2", "data.format=rlfh",
              f"data.train={outage_env['data']}"]
    plan = [{"name": name, "stage": "grpo", "config": "tiny_cpu_klcf",
             "overrides": [*common, f"exp_manager.explicit_log_dir={out / name}"]} for name in ("undisturbed", "restarted")]
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps(plan))
    events: dict[str, float] = {}
    with ExitStack() as stack:
        server = _serve(outage_env, stack, "serve_tp2")
        chaos = threading.Thread(target=_disturb, args=(server, stack, outage_env, out / "restarted" / "metrics.jsonl", events),
                                 daemon=True)
        chaos.start()
        res = run_in_aligner_venv(venv, ["tests/trainers/aligner_driver.py", f"--nemo={stage_policy}", f"--out={out}",
                                         "--scenario=outage", f"--plan={out / 'plan.json'}", "--tp=2"], nproc=2, timeout=700)
        chaos.join(timeout=60)
    assert res.returncode == 0, res.stdout[-6000:]
    assert "killed" in events and "back" in events, "the server was not disturbed during the second run"
    waits = [ln for ln in res.stdout.splitlines() if "retrying the same request" in ln]
    assert waits and all(url in ln for ln in waits), res.stdout[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        a, b = (_no_timings(rank["stages"][name]["logged"]) for name in ("undisturbed", "restarted"))
        assert [m["step"] for m in b] == [1, 2] and a == b
    assert _no_timings(ranks[0]["stages"]["restarted"]["logged"]) == _no_timings(ranks[1]["stages"]["restarted"]["logged"])
    # at TP=2 one rank (the model-parallel source) talks to the server, the other gets its result; each step's 4
    # rollouts come in micro batches of at most 3 (the driver's rollout_micro_batch_size), each scored as generated
    assert [len(r["stages"]["restarted"]["calls"]) for r in ranks] == [4, 0]


def _no_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]
