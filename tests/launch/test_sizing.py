"""Het groups sized from the job (issue 43 item 11), through the real command (`python -m nemo_factuality.cli launch
STAGE.yaml --dry-run`): a CPU-only server group asks the memory its servers declare (not the profile's `mem: "0"`, a
whole node's), the judges' group the GPUs its judges use on its busiest node (not the partition's), and a size no
node can hold is one line, exit 2. Every expected number is worked out by hand from the stage written here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from nemo_factuality.config import REPO_ROOT

# h100_pyxis: 8 GPUs per node, cpus_per_task 16, mem "0" (the trainer's group), node memory unknown
CPUS = "--cpus-per-task=16"


def _demo_server(name: str, port: int, **spec) -> dict:
    """A CPU reward server (`nemo-factuality serve` of the demo config, no judges), its ports its own."""
    command = ("nemo-factuality serve --config-name demo http_port={port} health_port={health_port} "
               "grpc_port={grpc_port} triton_metrics_port={triton_metrics_port} metrics_port={metrics_port}")
    return {"name": name, "port": port, "health_port": port + 1, "health_path": "/health/ready", "command": command,
            "ports": {"grpc_port": port + 2, "triton_metrics_port": port + 3, "metrics_port": port + 4}, **spec}


def _cpu_stage() -> dict:
    """Two CPU-only reward servers: `small` declares 4 GiB, `big` declares nothing (cpu_server_mem_gb: 16 GiB)."""
    return {"job_name": "sizing", "reward_servers": [_demo_server("small", 18000, mem_gb=4), _demo_server("big", 18100)]}


def _judge_stage(judge: dict | None = None, info: dict | None = None) -> dict:
    """RLFH with informativeness on a judge of its own: the judge at TP=2 (2 GPUs), the info judge on 1 GPU."""
    vllm = "vllm serve {model} --served-model-name {{served_model_name}} --tensor-parallel-size {{gpus}} --port {{port}}"
    reward = ("nemo-factuality serve --config-name rlfh http_port={port} health_port={health_port} grpc_port={grpc_port} "
              "triton_metrics_port={triton_metrics_port} metrics_port={metrics_port} policy_tokenizer=/m/policy "
              "reward.info_judge.base_url=http://127.0.0.1:8001/v1 reward.info_judge.model=Qwen2.5-7B-Instruct")
    ports = {"grpc_port": 5565, "triton_metrics_port": 5575, "metrics_port": 5581}
    return {"job_name": "sizing", "reward_servers": [{"name": "factuality_reward", "port": 5555, "health_port": 5580,
                                                      "health_path": "/health/ready", "command": reward, "ports": ports}],
            "judges": [{"name": "judge", "port": 8000, "gpus": 2, "image": "judge", "serves": ["reward.judge"],
                        "command": vllm.format(model="/m/judge"), **(judge or {})},
                       {"name": "info_judge", "port": 8001, "gpus": 1, "image": "judge", "serves": ["reward.info_judge"],
                        "command": vllm.format(model="/m/info"), **(info or {})}]}


def _dry_run(tmp_path: Path, stage: dict, *overrides: str) -> subprocess.CompletedProcess:
    (tmp_path / "stage.yaml").write_text(yaml.safe_dump(stage))
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("NEMO_FACTUALITY_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "launch", "stage.yaml", "--cluster", "h100_pyxis",
                           "--dry-run", "--out", "job.sbatch", *overrides], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)


def _headers(tmp_path: Path, stage: dict, *overrides: str) -> list[str]:
    """The ``#SBATCH --nodes=...`` line of each het group of the rendered job, in group order."""
    res = _dry_run(tmp_path, stage, *overrides)
    assert res.returncode == 0, res.stderr
    return [line for line in res.stdout.splitlines() if line.startswith("#SBATCH --nodes=")]


def test_a_cpu_only_reward_group_asks_its_servers_memory_not_a_whole_node(tmp_path):
    trainer, rewards = _headers(tmp_path, _cpu_stage())
    assert trainer.endswith(" --mem=0")  # the trainer's group keeps the profile's mem
    # both on one node (no GPUs to split): (4 + 16) GiB x (1 + 0.25 headroom) = 25 GiB; no GPU asked
    assert rewards == f"#SBATCH --nodes=1 --ntasks-per-node=2 {CPUS} --mem=25G"
    # the stage's default and headroom are config keys: (4 + 10) x 1.5 = 21 GiB
    assert _headers(tmp_path, _cpu_stage(), "cpu_server_mem_gb=10", "server_mem_headroom=0.5")[1].endswith(" --mem=21G")
    # a whole MiB count that is no whole GiB is written in MiB: (4 + 0.5) x 1.25 = 5.625 GiB = 5760 MiB
    assert _headers(tmp_path, _cpu_stage(), "cpu_server_mem_gb=0.5")[1].endswith(" --mem=5760M")


def test_a_known_node_memory_packs_the_servers_and_caps_the_request(tmp_path):
    # nodes of 18 GiB: small (4) on node 0, big (16) does not fit beside it (20 > 18): node 1. The busiest node asks
    # 16 x 1.25 = 20 GiB, more than the node has: capped at 18 GiB
    rewards = _headers(tmp_path, _cpu_stage(), "cluster.node_mem_gb=18")[1]
    assert rewards == f"#SBATCH --nodes=2 --ntasks-per-node=1 {CPUS} --mem=18G"
    # nodes of 24 GiB: both fit on one (20 <= 24), asking 20 x 1.25 = 25 GiB, capped at 24 GiB
    rewards = _headers(tmp_path, _cpu_stage(), "cluster.node_mem_gb=24")[1]
    assert rewards == f"#SBATCH --nodes=1 --ntasks-per-node=2 {CPUS} --mem=24G"


def test_a_server_bigger_than_a_node_is_one_line_exit_2(tmp_path):
    res = _dry_run(tmp_path, _cpu_stage(), "cluster.node_mem_gb=12")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and res.stdout == "", res.stderr
    assert ("server 'big' needs 16 GiB of memory (cpu_server_mem_gb, its default without GPUs) but the profile's "
            "nodes have 12 GiB (node_mem_gb)") in lines[0]
    assert "'small'" not in lines[0] and not (tmp_path / "job.sbatch").exists()
    stage = _cpu_stage()
    stage["reward_servers"][0]["mem_gb"] = 0  # --mem=0 would be a whole node again
    res = _dry_run(tmp_path, stage)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "server 'small' has mem_gb=0: give the GiB it needs (> 0" in res.stderr


def test_the_judges_group_asks_the_gpus_its_judges_use(tmp_path):
    trainer, reward, judges = _headers(tmp_path, _judge_stage())
    assert reward == f"#SBATCH --nodes=1 --ntasks-per-node=1 {CPUS} --mem=20G"  # the RLFH reward server: 16 x 1.25
    # 2 + 1 GPUs on one 8-GPU node: 3, not the partition's 8; GPU servers that declare no memory: the profile's mem
    assert judges == f"#SBATCH --nodes=1 --ntasks-per-node=2 --gpus-per-node=3 {CPUS} --mem=0"
    # 2-GPU nodes: the judge fills node 0, the info judge goes to node 1; the busiest node uses 2
    judges = _headers(tmp_path, _judge_stage(), "cluster.gpus_per_node=2", "cluster.gpu_numa_nodes=[0,1]")[2]
    assert judges == f"#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=2 {CPUS} --mem=0"
    # judges that declare their host memory get it summed too: (64 + 32) x 1.25 = 120 GiB
    judges = _headers(tmp_path, _judge_stage(judge={"mem_gb": 64}, info={"mem_gb": 32}))[2]
    assert judges == f"#SBATCH --nodes=1 --ntasks-per-node=2 --gpus-per-node=3 {CPUS} --mem=120G"
