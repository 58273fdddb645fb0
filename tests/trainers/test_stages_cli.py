"""Every method's reward through its stage, built from conf/train presets by the real entry points.

The LLM judges are a real loopback OpenAI-protocol server with scripted replies; the knowledge store is
real SQLite; one stage gets its reward from the real PyTriton server; the Slurm entry point
(``python -m nemo_factuality.trainers.grpo``) is checkpointed by SIGUSR1 and resumed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from nemo_factuality.testing.fake_openai import Reply, ScriptedOpenAIServer
from nemo_factuality.testing.methods import FACTS, build_kb, method_judge
from nemo_factuality.testing.training import read_metrics, write_jsonl
from nemo_factuality.trainers.cli import main as train_main


@pytest.fixture(scope="module")
def judge():
    with ScriptedOpenAIServer(method_judge) as server:
        yield server


@pytest.fixture(scope="module")
def kb(tmp_path_factory):
    return str(build_kb(tmp_path_factory.mktemp("train_kb")))


def _common(policy: Path, run_dir: Path) -> list[str]:
    return [f"model.path={policy}", f"exp_manager.explicit_log_dir={run_dir}", "model.length_params.max_length=8"]


def _check_run(run_dir: Path, steps: int) -> list[dict]:
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        losses = {k: v for k, v in m.items() if k.startswith("loss/")}
        assert losses and all(v is not None and math.isfinite(v) for v in losses.values()), m
        assert m["time/generate"] > 0 and m["time/reward"] > 0 and m["time/train"] >= 0
    assert (run_dir / "final" / "config.json").exists() and (run_dir / "config.yaml").exists()
    assert list((run_dir / "tensorboard").glob("events.*"))
    return metrics


KLCF_ROLES = ("judge", "checklist_judge", "pipeline.extractor.judge", "pipeline.verifier.judge")


def _klcf_data(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "klcf.jsonl", [{"prompt": f"Tell me about Ada {i}.", "checklist": ["Ada was born in 1917."]}
                                                 for i in range(4)])


def test_klcf_grpo(tiny_policy, judge, tmp_path):
    data = _klcf_data(tmp_path)
    roles = [f"reward.{k}.base_url={judge.url}" for k in KLCF_ROLES]
    old_umask = os.umask(0o022)
    try:
        assert train_main(["grpo", "--config-name", "tiny_cpu_klcf", *_common(tiny_policy, tmp_path / "run"),
                           f"data.train={data}", *roles, "reward.w_rm=0", "reward.general_rm=null"]) == 0
    finally:
        os.umask(old_umask)
    metrics = _check_run(tmp_path / "run", 3)
    assert metrics[0]["reward/checklist_recall"] == 1.0 and metrics[0]["reward/truthfulness_precision"] == 1.0
    # the outputs get the mode any file gets under umask 022 (safetensors writes 0600 through a temporary file)
    final = tmp_path / "run" / "final" / "model.safetensors"
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000003" / "policy.safetensors"
    assert [oct(p.stat().st_mode & 0o777) for p in (final, checkpoint)] == ["0o644", "0o644"]


def test_in_process_reward_with_judges_down_fails_at_start_naming_url_and_key(tiny_policy, judge, tmp_path, capsys):
    """Before: every reward NaN, 0 optimiser steps, exit 0. Now: one line, exit 2, before any step."""
    from nemo_factuality.cli import main as cli
    from nemo_factuality.testing.ports import free_ports

    (down_port,) = free_ports(1)  # nothing listens there
    outage = ScriptedOpenAIServer(method_judge)
    outage.models_status = 503  # up, but its health check (GET /v1/models) fails
    with outage:
        outage_url = outage.url
        overrides = [f"reward.judge.base_url={judge.url}", f"reward.pipeline.extractor.judge.base_url={judge.url}",
                     f"reward.checklist_judge.base_url={outage.url}",
                     f"reward.pipeline.verifier.judge.base_url=http://127.0.0.1:{down_port}/v1",
                     "reward.w_rm=0", "reward.general_rm=null"]
        start = time.monotonic()
        code = cli(["train", "grpo", "--config-name", "tiny_cpu_klcf", *_common(tiny_policy, tmp_path / "run"),
                    f"data.train={_klcf_data(tmp_path)}", *overrides])
    assert code == 2 and time.monotonic() - start < 60
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("nemo-factuality train: error: the reward is not ready"), errors
    line = errors[0]
    assert f"http://127.0.0.1:{down_port}/v1 unreachable" in line and "(config key reward.pipeline.verifier.judge.base_url)" in line
    assert f"{outage_url}/models answered HTTP 503 (config key reward.checklist_judge.base_url)" in line
    assert judge.url not in line  # the healthy judge is not blamed
    # issue 43: nothing is written before start-up passes (before: config.yaml was left in the run folder)
    assert not (tmp_path / "run").exists()


def test_vllm_rollouts_without_vllm_are_refused_in_one_line_before_the_policy_loads(tiny_policy, tmp_path):
    """Issue 43: before, a 37-line ModuleNotFoundError traceback from the engine's log, after the model had loaded.
    Issue 54 item 5: the engine's Python is checked before anything loads — before, the one line came after the
    policy's weights had loaded (a "Loading weights" progress bar on stderr first; minutes at 32B): now stderr is that
    line alone and the process never built a torch module."""
    import sys

    from nemo_factuality.config import REPO_ROOT

    # the count walks every object (warnings off: touching a deprecated alias of torch.distributed warns)
    probe = ("import gc, sys, warnings\nfrom nemo_factuality.cli import main\ncode = main(sys.argv[1:])\nimport torch\n"
             "warnings.simplefilter('ignore')\nprint(code, sum(isinstance(o, torch.nn.Module) for o in gc.get_objects()))")
    args = ["train", "grpo", "--config-name", "tiny_cpu_klcf", *_common(tiny_policy, tmp_path / "run"),
            f"data.train={_klcf_data(tmp_path)}", "rollout.engine=vllm", f"rollout.vllm.python={sys.executable}"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("NEMO_FACTUALITY_DEBUG", None)
    res = subprocess.run([sys.executable, "-c", probe, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert res.stdout.split() == ["2", "0"], (res.stdout, res.stderr[-2000:])  # exit 2, no torch module built
    errors = res.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("nemo-factuality train: error: "), res.stderr[-2000:]
    assert f"{sys.executable} cannot import vllm; point rollout.vllm.python" in errors[0]
    assert "bash tools/setup_stack_env.sh vllm" in errors[0]
    assert not (tmp_path / "run").exists()  # nothing written before start-up passed


def _failing_judge(req: dict) -> Reply:
    """Healthy (GET /v1/models answers) but every completion is refused: every reward NaN."""
    return Reply("scripted refusal", status=400)


def test_steps_without_a_valid_sample_stop_the_run_with_a_checkpoint(tiny_policy, tmp_path, capsys):
    from nemo_factuality.cli import main as cli

    run_dir = tmp_path / "run"
    with ScriptedOpenAIServer(_failing_judge) as failing:
        code = cli(["train", "grpo", "--config-name", "tiny_cpu_klcf", *_common(tiny_policy, run_dir),
                    f"data.train={_klcf_data(tmp_path)}", *[f"reward.{k}.base_url={failing.url}" for k in KLCF_ROLES],
                    "reward.w_rm=0", "reward.general_rm=null", "trainer.max_steps=10", "trainer.max_invalid_steps=2"])
    assert code == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "stopped at step 2: 2 consecutive steps had no valid sample" in errors[0], errors
    assert "reward NaN for 100% of the samples" in errors[0] and "trainer.max_invalid_steps=2" in errors[0]
    assert [m["valid_frac"] for m in read_metrics(run_dir)] == [0.0, 0.0]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000002" and not (run_dir / "final").exists()


def test_a_kto_iteration_the_labeller_could_not_label_stops_the_run(tiny_policy, kb, tmp_path, capsys):
    from nemo_factuality.cli import main as cli

    run_dir = tmp_path / "run"
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Write a bio of Ada Varga ({i}).", "topic": "Ada Varga"}
                                                    for i in range(4)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Say hi.", "chosen": "Hi there.", "rejected": "No."}])
    with ScriptedOpenAIServer(_failing_judge) as failing:
        code = cli(["train", "kto", "--config-name", "tiny_cpu_factalign", *_common(tiny_policy, run_dir),
                    f"data.train={data}", f"data.general_pairs={pairs}", f"reward.judge.base_url={failing.url}",
                    f"reward.pipeline.evidence.store_path={kb}"])
    assert code == 3
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "iteration 0: the labeller could not label any of the 8 samples" in errors[0], errors
    assert "checkpoints/step_000000 is written" in errors[0]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000000" and not (run_dir / "final").exists()


def test_fspo_grpo_from_parquet(tiny_policy, tiny_nli, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    template = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>"
    rows = [{"prompt": [{"role": "user", "content": template.format(q=f"Who was born in 1917? ({i})")}],
             "reward_model": {"style": "rule", "ground_truth": "Ada Varga"}, "knowledge": FACTS[0][3],
             "data_source": "HotpotQA"} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert train_main(["grpo", "--config-name", "tiny_cpu_fspo", *_common(tiny_policy, tmp_path / "run"),
                       f"data.train={tmp_path / 'train.parquet'}", f"reward.verifier.model_path={tiny_nli}"]) == 0
    metrics = _check_run(tmp_path / "run", 3)
    assert metrics[0]["reward/format"] == -2.0  # the untrained policy never writes the tags


def test_knowrl_grpo(tiny_policy, tiny_nli, judge, kb, tmp_path):
    items = [{"question": f"When was Ada Varga born? ({i})", "answers": "1917", "title": "Ada Varga;Lev Novak"} for i in range(4)]
    (tmp_path / "knowrl.json").write_text(json.dumps(items))
    assert train_main(["grpo", "--config-name", "tiny_cpu_knowrl", *_common(tiny_policy, tmp_path / "run"),
                       f"data.train={tmp_path / 'knowrl.json'}", f"reward.judge.base_url={judge.url}",
                       f"reward.pipeline.evidence.store_path={kb}", f"reward.pipeline.verifier.model_path={tiny_nli}"]) == 0
    metrics = _check_run(tmp_path / "run", 3)
    assert metrics[0]["reward/format"] == -1.0


def test_rlfh_ppo(tiny_policy, judge, tmp_path, caplog, capfd):
    import logging

    caplog.set_level(logging.INFO)
    data = write_jsonl(tmp_path / "hotpot.jsonl", [{"question": f"When was Ada Varga born ({i})?", "titles": ["Ada Varga"],
                                                    "materials": [FACTS[0][3]], "extra_materials": []} for i in range(8)])
    assert train_main(["ppo", "--config-name", "tiny_cpu_rlfh", *_common(tiny_policy, tmp_path / "run"), f"data.train={data}",
                       f"reward.judge.base_url={judge.url}"]) == 0
    metrics = _check_run(tmp_path / "run", 3)
    assert all(math.isfinite(m["loss/value"]) for m in metrics)
    # issue 54 item 6: PPO's lines under its own logger (before: nemo_factuality.trainers.grpo, whose loop it runs)
    stage_lines = {(r.name, r.getMessage().split(":")[0]) for r in caplog.records
                   if r.getMessage().startswith(("step ", "training finished"))}
    final = tmp_path / "run" / "final"
    assert stage_lines == {("nemo_factuality.trainers.ppo", f"step {i}") for i in (1, 2, 3)} | {
        ("nemo_factuality.trainers.ppo", f"training finished at step 3 (max_steps); final policy in {final}")}
    # and the critic made from the policy loads without transformers' LOAD REPORT table (value head MISSING, lm_head
    # UNEXPECTED: by design), on file descriptor 2, where transformers' own handler writes
    assert "LOAD REPORT" not in capfd.readouterr().err


def test_factalign_kto(tiny_policy, judge, kb, tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Write a bio of Ada Varga ({i}).", "topic": "Ada Varga"}
                                                    for i in range(4)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Say hi.", "chosen": "Hi there.", "rejected": "No."}])
    assert train_main(["kto", "--config-name", "tiny_cpu_factalign", *_common(tiny_policy, tmp_path / "run"),
                       f"data.train={data}", f"data.general_pairs={pairs}", f"reward.judge.base_url={judge.url}",
                       f"reward.pipeline.evidence.store_path={kb}"]) == 0
    metrics = read_metrics(tmp_path / "run")
    # per iteration: 4 prompts × 2 samples labelled + 1 general pair (chosen + rejected) = 10 examples → 3 minibatches of 4
    assert len(metrics) == 2 * 3
    assert metrics[0]["kto/labelled"] + metrics[0]["kto/dropped_unlabelled"] == 8
    assert all(math.isfinite(m["loss/kto"]) for m in metrics)


def test_kto_prints_its_steps_and_samples_no_iteration_it_will_not_train(tiny_policy, judge, kb, tmp_path, capsys, caplog):
    """Issue 54 item 1, through the command: per-step lines and the closing line GRPO and PPO print; with
    trainer.max_steps on an iteration's last step the next iteration is not sampled nor labelled, and that step's
    checkpoint is written (and logged) once. Before: no step line, no closing line, iteration 1 sampled and labelled
    (its judge calls thrown away), step_000003 saved three times."""
    import logging

    from nemo_factuality.cli import main as cli

    caplog.set_level(logging.INFO)
    data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Write a bio of Ada Varga ({i}).", "topic": "Ada Varga"}
                                                    for i in range(4)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "Say hi.", "chosen": "Hi there.", "rejected": "No."}])
    run_dir = tmp_path / "run"
    # 4 prompts × 2 samples + one pair (2 rows) = 10 examples: 3 minibatches of 4, so step 3 ends iteration 0
    assert cli(["train", "kto", "--config-name", "tiny_cpu_factalign", *_common(tiny_policy, run_dir),
                f"data.train={data}", f"data.general_pairs={pairs}", f"reward.judge.base_url={judge.url}",
                f"reward.pipeline.evidence.store_path={kb}", "trainer.max_steps=3", "trainer.save_interval=3",
                "trainer.progress_bar=true"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "nemo_factuality.trainers.kto"]
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"], lines
    assert all("(iteration 1/2, minibatch" in line and "loss/kto" in line and "% desirable" in line for line in steps)
    assert lines[-1] == f"training finished at step 3 (max_steps); final policy in {run_dir / 'final'}", lines
    bars = capsys.readouterr().err
    assert "kto iteration 1/2: sample+label" in bars and "kto iteration 2/2" not in bars, bars[-2000:]
    saved = [r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint saved")]
    assert saved == [f"checkpoint saved: {run_dir / 'checkpoints' / 'step_000003'}"], saved
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3] and (run_dir / "final" / "config.json").exists()


def test_grpo_through_the_pytriton_reward_server(tiny_policy, kb, tmp_path):
    pytest.importorskip("pytriton")
    from nemo_factuality.registry import REWARDS
    from nemo_factuality.serving.config import ServeConfig
    from nemo_factuality.serving.server import FactualityRewardServer
    from nemo_factuality.testing.ports import free_ports

    os.environ.setdefault("PYTRITON_HOME", str(tmp_path / "pytriton_home"))
    reward = REWARDS.build({"name": "factalign", "k": 10, "pipeline": {"verifier": {"name": "kb_exact", "store_path": kb}}})
    http, grpc, tmetrics, health, metrics_port = free_ports(5)
    cfg = ServeConfig(host="127.0.0.1", http_port=http, grpc_port=grpc, triton_metrics_port=tmetrics, health_port=health,
                      metrics_port=metrics_port, max_queue_delay_us=500)
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Who is Ada Varga ({i})?", "topic": "Ada Varga"} for i in range(4)])
    with FactualityRewardServer(cfg, reward):
        assert train_main(["grpo", "--config-name", "tiny_cpu_klcf", *_common(tiny_policy, tmp_path / "run"),
                           "reward=null", f"remote_rm.url=http://127.0.0.1:{http}", "data.format=jsonl",
                           f"data.train={data}"]) == 0
    metrics = _check_run(tmp_path / "run", 3)
    assert "reward/f1" in metrics[0]  # the labeller's components came back over the wire


def test_bad_configs_fail_at_start_naming_the_key(tiny_policy, tmp_path, capsys):
    from nemo_factuality.config import ConfigError
    from nemo_factuality.types import FactualityInputError

    base = _common(tiny_policy, tmp_path / "run")
    with pytest.raises(ConfigError, match=r"reward.name='nosuch' is not a known reward"):
        train_main(["grpo", "--config-name", "tiny_cpu_klcf", *base, "reward.name=nosuch"])
    with pytest.raises(ConfigError, match=r"model.global_batch_size \(6\) must be a multiple of model.micro_batch_size"):
        train_main(["grpo", "--config-name", "tiny_cpu_klcf", *base, "model.global_batch_size=6"])
    with pytest.raises(ConfigError, match="no reward"):
        train_main(["grpo", "--config-name", "tiny_cpu_klcf", *base, "reward=null"])
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "checklist": []}])
    # issue 54 item 2: an in-process reward's store that is a directory (before: "does not exist")
    with pytest.raises(FactualityInputError, match=rf"knowledge store {tmp_path} is a directory, not a file"):
        train_main(["kto", "--config-name", "tiny_cpu_factalign", *base, f"data.train={data}",
                    f"reward.pipeline.evidence.store_path={tmp_path}"])
    from nemo_factuality.testing.ports import free_ports

    (port,) = free_ports(1)
    start = time.monotonic()
    with pytest.raises(FactualityInputError, match=rf"127.0.0.1:{port}.*remote_rm.url"):
        train_main(["grpo", "--config-name", "tiny_cpu_klcf", *base, "reward=null", f"data.train={data}",
                    f"remote_rm.url=http://127.0.0.1:{port}", "remote_rm.init_timeout_s=2"])
    assert time.monotonic() - start < 60  # a refused connection fails fast, not after Aligner's 600000 s
    from nemo_factuality.cli import main as cli

    assert cli(["train", "nosuchstage"]) == 2
    assert cli(["train", "grpo", "--config-name", "tiny_cpu_klcf", "--bogus-flag"]) == 2
    assert cli(["train", "grpo", "--config-name", "tiny_cpu_klcf", *base, "reward.name=nosuch"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 3 and all(line.startswith("nemo-factuality train") for line in errors), errors
    assert "Traceback" not in err


def test_sigusr1_checkpoints_and_the_rerun_resumes(tiny_policy, kb, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"Who is Ada Varga ({i})?", "topic": "Ada Varga"} for i in range(4)])
    run_dir = tmp_path / "run"
    config = tmp_path / "grpo_demo.yaml"  # a whole config file, as a user would write one
    config.write_text(f"""
trainer: {{max_steps: 200, save_interval: 0, progress_bar: false}}
grpo: {{num_prompts_per_step: 2, num_rollouts_per_prompt: 4, truncated: keep}}
model: {{micro_batch_size: 4, global_batch_size: 8, optim: {{lr: 1.0e-3}}}}
data: {{format: jsonl, train: {data}}}
reward: {{name: factalign, k: 10, pipeline: {{verifier: {{name: kb_exact, store_path: {kb}}}}}}}
""")
    args = [sys.executable, "-m", "nemo_factuality.trainers.grpo", "--config-name", str(config),
            *_common(tiny_policy, run_dir), "trainer.max_steps=200"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "timeout"
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert stopped_at < 200 and "SIGUSR1" in out
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{stopped_at:06d}"
    # the requeued job: same command, fewer steps so the test stays short; it resumes from the checkpoint
    args[args.index("trainer.max_steps=200")] = f"trainer.max_steps={stopped_at + 2}"
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"(step {stopped_at})" in res.stderr
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, stopped_at + 3))


@pytest.mark.parametrize("method", ["klcf", "fspo", "knowrl", "rlfh", "factalign"])
def test_train_and_serve_configs_use_the_same_reward(method):
    from omegaconf import OmegaConf

    from nemo_factuality.config import conf_dir

    train = OmegaConf.load(conf_dir() / "train" / f"{method}.yaml")["reward"]
    serve = OmegaConf.load(conf_dir() / "serve" / f"{method}.yaml")["reward"]
    assert OmegaConf.to_container(train) == OmegaConf.to_container(serve)


@pytest.mark.parametrize("stage", ["grpo_klcf", "grpo_fspo", "grpo_knowrl", "ppo_rlfh", "kto_factalign", "cpu_standin",
                                   "cpu_standin_klcf"])
def test_launch_stages_pass_overrides_the_train_schema_accepts(stage):
    """Every key=value a Slurm stage hands its trainer exists in that stage's schema (no silent typo)."""
    import re
    import shlex

    import yaml

    from nemo_factuality.config import conf_dir
    from nemo_factuality.trainers import config as schemas
    from nemo_factuality.trainers.cli import STAGES

    command = yaml.safe_load((conf_dir() / "launch" / f"{stage}.yaml").read_text())["trainer_command"]
    command = re.sub(r"(?<!\$)\{(\w+)\}", r"/\1", command.replace("{ckpt_dir}", "/ckpt"))  # {params.x} -> /x
    words = shlex.split(command.split("&&")[-1].replace("exec ", "").replace("$FACTUALITY_REWARD_URL", "http://reward:5555"))
    module = words[words.index("-m") + 1]
    name = words[words.index("--config-name") + 1]
    overrides = [w for w in words if "=" in w and not w.startswith("-")]
    schema = getattr(schemas, STAGES[module.rsplit(".", 1)[-1]][0])
    cfg = schemas.load_config(schema, name, overrides + ["model.path=/models/policy"], group="train")
    assert cfg.remote_rm.resolved_url() == "http://reward:5555" and cfg.exp_manager.explicit_log_dir == "/ckpt"
    assert cfg.reward is None


def test_ppo_on_the_aligner_backend_without_a_critic_server_is_refused_at_start(tmp_path, capsys):
    from nemo_factuality.cli import main as cli

    assert cli(["train", "ppo", "--config-name", "tiny_cpu_rlfh", "trainer.backend=aligner",
                "model.restore_from_path=/x.nemo", f"exp_manager.explicit_log_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "critic.url must name the critic server" in err and len(err.strip().splitlines()) == 1


def _rollout_of(tokenizer, prompt_ids: list[int], responses: list[str]):
    """One prompt's group: the prompt followed by each response's tokens and EOS (Aligner's right-padded layout)."""
    import torch

    from nemo_factuality.trainers.interfaces import Rollout

    rows = [prompt_ids + tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for r in responses]
    tokens = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id, dtype=torch.long)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = torch.tensor(r)
    return Rollout(tokens, torch.tensor([len(prompt_ids)] * len(rows)), torch.tensor([len(r) for r in rows]),
                   torch.ones(len(rows), dtype=torch.bool))


@pytest.mark.slow
def test_served_fspo_and_knowrl_rewards_vary_within_a_group_and_fspo_flips(tiny_policy, tiny_nli, judge, kb, tmp_path):
    """The served FSPO and KnowRL rewards (``nemo-factuality serve``) on one group of formatted / unformatted, right /
    wrong responses (an untrained policy never writes the tags, so its rewards are constant): the scores differ,
    the group advantages are not 0, FSPO's token signs come over the wire and its flip runs, and the update moves
    the weights."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from nemo_factuality.serving.client import RemoteFactualityReward
    from nemo_factuality.testing.servers import reward_server
    from nemo_factuality.trainers.backends.hf.actor import HFActor
    from nemo_factuality.trainers.config import GRPOConfig, load_train_config
    from nemo_factuality.trainers.data import load_prompts
    from nemo_factuality.trainers.grpo import GRPOTrainer
    from nemo_factuality.trainers.runtime import encode_prompts, records_for_rows, score_rollout

    template = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\nLet me solve this step by step.\n<think>"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": template.format(q="Who was born in 1917?")}],
                                          "reward_model": {"style": "rule", "ground_truth": "Ada Varga"},
                                          "knowledge": FACTS[0][3], "data_source": "HotpotQA"}]), tmp_path / "fspo.parquet")
    (tmp_path / "knowrl.json").write_text(json.dumps([{"question": "When was Ada Varga born?", "answers": "1917",
                                                       "title": "Ada Varga;Lev Novak"}]))
    groups = {  # right, wrong, right with a second step, no format
        "fspo": [" Ada Varga was born in 1917.</think><answer>Ada Varga</answer>",
                 " Lev Novak was born in 1850.</think><answer>Lev Novak</answer>",
                 " Ada Varga was born in 1917. She wrote poems.</think><answer>Ada Varga</answer>", "no tags at all"],
        "knowrl": ["<think>Ada Varga was born in 1917.</think><answer>1917</answer>",
                   "<think>She was born long ago.</think><answer>1850</answer>",
                   "<think>Ada Varga was born in 1917 in Pécs.</think><answer>1917</answer>", "no tags at all"]}
    serve = {"fspo": [f"reward.verifier.model_path={tiny_nli}"],
             "knowrl": [f"reward.judge.base_url={judge.url}", f"reward.pipeline.evidence.store_path={kb}",
                        f"reward.pipeline.verifier.model_path={tiny_nli}"]}
    data = {"fspo": ("fspo", tmp_path / "fspo.parquet"), "knowrl": ("knowrl", tmp_path / "knowrl.json")}
    with ExitStack() as stack:
        servers = {m: stack.enter_context(reward_server(m, [f"policy_tokenizer={tiny_policy}", *serve[m]], tmp_path / m, {}))
                   for m in groups}
        for server in servers.values():
            server["wait_ready"]()
        for method, responses in groups.items():
            cfg = load_train_config(GRPOConfig, f"tiny_cpu_{method}", [
                f"model.path={tiny_policy}", "reward=null", f"remote_rm.url={servers[method]['url']}",
                f"data.format={data[method][0]}", f"data.train={data[method][1]}", "grpo.num_prompts_per_step=1",
                "grpo.num_rollouts_per_prompt=4", "model.global_batch_size=4", "model.micro_batch_size=4",
                f"exp_manager.explicit_log_dir={tmp_path / ('run_' + method)}", "grpo.truncated=keep"])
            records = load_prompts(cfg.data.train, cfg.data.format)
            torch.manual_seed(0)
            actor = HFActor(cfg.model, max_steps=1)
            reward = RemoteFactualityReward(servers[method]["url"])
            trainer = GRPOTrainer(cfg, actor, reward, records, run_dir=tmp_path / f"run_{method}")
            prompt_ids = encode_prompts(records, actor.tokenizer, cfg.data.apply_chat_template, cfg.data.max_prompt_tokens)[0]
            rollout = _rollout_of(actor.tokenizer, prompt_ids, responses)
            batch, _ = score_rollout(reward, rollout, records_for_rows(records, 4), actor.tokenizer, actor.eos_id)
            assert len(set(batch.scores.round(6).tolist())) >= 2, (method, batch.scores)  # the rewards differ
            exp, metrics = trainer.make_experience(rollout, batch.scores, batch.token_signs)
            assert metrics["advantage/abs_mean"] > 0, method
            if method == "fspo":
                assert batch.token_signs is not None and any(np.any(s != 0) for s in batch.token_signs)
                assert metrics["fspo/flip_frac"] > 0  # some token's sign disagrees with its sample's advantage
                plain, _ = trainer.make_experience(rollout, batch.scores, None)  # the same group without the flip
                assert ((exp["advantages"] * plain["advantages"]) < 0).any()  # ... and its advantage was turned around
            before = [p.detach().clone() for p in actor.model.parameters()]
            result = trainer.update(exp)
            assert result["optimizer_steps"] == 1 and result["grad_norm"] > 0, method
            assert any(not torch.equal(a, b) for a, b in zip(before, actor.model.parameters(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["ppo", "kto"])
def test_the_real_command_at_data_parallel_2_on_the_hf_backend(stage, tiny_policy, judge, kb, tmp_path):
    """``torchrun --no-python --nproc_per_node 2 nemo-factuality train …``: two full replicas (gloo), the critic's and
    KTO's gathers included; one run directory written by rank 0 alone."""
    from nemo_factuality.testing.aligner_env import run_bounded
    from nemo_factuality.testing.ports import free_ports

    run_dir = tmp_path / "run"
    if stage == "ppo":
        data = write_jsonl(tmp_path / "hotpot.jsonl", [
            {"question": f"When was Ada Varga born ({i})?", "titles": ["Ada Varga"], "materials": [FACTS[0][3]],
             "extra_materials": []} for i in range(8)])
        args = ["--config-name", "tiny_cpu_rlfh", f"reward.judge.base_url={judge.url}"]
    else:
        data = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Write a bio of Ada Varga ({i}).", "topic": "Ada Varga"}
                                                        for i in range(4)])
        args = ["--config-name", "tiny_cpu_factalign", f"reward.judge.base_url={judge.url}",
                f"reward.pipeline.evidence.store_path={kb}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--no-python", "--nproc_per_node=2",
           f"--master_port={free_ports(1)[0]}", "--master_addr=127.0.0.1",
           str(Path(sys.executable).parent / "nemo-factuality"), "train", stage, *args,
           *_common(tiny_policy, run_dir), f"data.train={data}", "trainer.max_steps=2", "model.micro_batch_size=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    res = run_bounded(cmd, timeout=400, env=env)
    assert res.returncode == 0, res.stdout[-5000:]
    metrics = read_metrics(run_dir)
    steps = [m["step"] for m in metrics]
    assert steps and steps == sorted(set(steps)), steps  # each step logged once, by rank 0
    assert all(math.isfinite(v) for m in metrics for k, v in m.items() if k.startswith("loss/"))
    assert (run_dir / "final" / "config.json").exists()
    assert "rank 1 of 2" in res.stdout
