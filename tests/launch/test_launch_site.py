"""A launch that fits any site (issue 50 item 9), read back from the rendered scripts: a megatron preset laid out on
nodes of another size (TP×PP and DP kept, nodes derived; every rank's engine GPUs as the trainer computes them), the
checkpoints under the profile's container mounts, ports of their own per job (servers and clients agreeing), and
``--cpus-per-task`` plus GPU/NUMA binding on every srun. Each expected value is worked out by hand from the preset or
stage named; before these changes each of these renders either did not exist or rendered the fixed values."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
from launch_helpers import expand, job_variables, load_site_stage, rendered, site_params, srun_steps

from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.launch.config import ClusterProfile
from nemo_factuality.launch.render import LaunchConfigError, render

H100 = load_config(ClusterProfile, "h100_pyxis", group="cluster")
FOUR_GPU = replace(H100, gpus_per_node=4, gpu_numa_nodes=[0, 0, 1, 1])  # a new user's site: 4-GPU nodes
STAGES = sorted(p.stem for p in (REPO_ROOT / "conf" / "launch").glob("*.yaml"))


def _cli(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    env.pop("NEMO_FACTUALITY_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "nemo_factuality.cli", "launch", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def _split(text: str) -> list[str]:
    block = text.split("# ---------- GPU split per node", 1)[1].split("\n", 1)[1]
    return [line[2:] for line in block.splitlines() if line.startswith("# ")]


# ------------------------------------------------------------------------------------------------ node sizes
def test_a_preset_on_4_gpu_nodes_is_refused_naming_the_way_around():
    with pytest.raises(LaunchConfigError, match=r"preset deepseek-r1-distill-qwen-7b runs 8 GPUs .* the profile's nodes "
                                                r"have 4 GPUs \(fit_nodes=true lays its trainer GPUs out on the profile's "
                                                r"nodes, TP, PP and DP kept, nodes derived\)"):
        render("megatron_grpo_fspo", load_site_stage("megatron_grpo_fspo"), FOUR_GPU)
    with pytest.raises(LaunchConfigError, match=r"an aligner preset's layout is NeMo's trainer's own; the megatron_\* "
                                                r"stage of the method with fit_nodes=true fits any node size"):
        render("aligner_grpo_klcf", load_site_stage("aligner_grpo_klcf"), FOUR_GPU)
    with pytest.raises(LaunchConfigError, match=r"fit_nodes=true: aligner preset qwen2\.5-32b cannot be laid out on "
                                                r"other nodes \(NeMo's trainer takes devices=8 and num_nodes=2"):
        render("aligner_grpo_klcf", load_site_stage("aligner_grpo_klcf", ["fit_nodes=true"]), FOUR_GPU)


def test_fit_nodes_lays_a_separate_engine_preset_out_on_4_gpu_nodes():
    """R1-Distill-7B: two TP=2 replicas (4 ranks, DP=2) beside their TP=2 engines on one 8-GPU node. On 4-GPU nodes a
    node holds one replica (GPUs 0-1) and its engine (2-3): 2 nodes × 2 ranks, the same 4 ranks, DP=2."""
    text = render("megatron_grpo_fspo", load_site_stage("megatron_grpo_fspo", ["fit_nodes=true"]), FOUR_GPU)
    assert "#SBATCH --nodes=2 --ntasks-per-node=2 --gpus-per-node=4 " in text
    srun = next(line for line, _ in srun_steps(text) if line.startswith("srun --het-group=0 "))
    assert srun.startswith("srun --het-group=0 --nodes=2 --ntasks-per-node=2 --kill-on-bad-exit=1 "
                           "--export=ALL,LOCAL_WORLD_SIZE=2,")
    assert "# fit_nodes: preset deepseek-r1-distill-qwen-7b's 1 node(s) x 8 GPUs laid out on 2 x 4 (TP=2, PP=1, DP=2 kept)" in text
    assert _split(text)[3:7] == ["node 0: trainer ranks 0-1 on GPUs 0-1",
                                 "  engine of replica 0 (started by rank 0): CUDA_VISIBLE_DEVICES=2,3",
                                 "node 1: trainer ranks 2-3 on GPUs 0-1",
                                 "  engine of replica 1 (started by rank 2): CUDA_VISIBLE_DEVICES=2,3"]
    assert "bash -c 'export CUDA_VISIBLE_DEVICES=0,1,2,3; python -m nemo_factuality.trainers.grpo" in text


def test_fit_nodes_gives_every_rank_the_engine_gpus_the_trainer_computes():
    """Colocated TP=4 engines (qwen2.5-14b KTO, 8 ranks, DP=2 on one 8-GPU node) on 4-GPU nodes: 2 nodes × 4 ranks;
    each rank's engine devices, computed by the trainer's own code from what the job gives it (LOCAL_WORLD_SIZE, the
    node's CUDA_VISIBLE_DEVICES), are the ones the script writes out."""
    from nemo_factuality.trainers.engines.vllm_rollout import engine_devices

    text = render("megatron_kto_factalign", load_site_stage("megatron_kto_factalign", ["fit_nodes=true"]), FOUR_GPU)
    assert "#SBATCH --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 " in text
    written = {int(m.group(1)): m.group(2).split(",") for line in _split(text)
               if (m := re.match(r"  engine of replica \d+ \(started by rank (\d+)\): CUDA_VISIBLE_DEVICES=([\d,]+)$", line))}
    assert written == {0: ["0", "1", "2", "3"], 4: ["0", "1", "2", "3"]}  # one engine per replica, on its own node
    cfg = SimpleNamespace(trainer=SimpleNamespace(device="cuda"),
                          model=SimpleNamespace(tensor_model_parallel_size=4, pipeline_model_parallel_size=1),
                          rollout=SimpleNamespace(vllm=SimpleNamespace(placement="colocated", tensor_parallel_size=4)))
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LOCAL_WORLD_SIZE": "4"}
    for rank in range(8):
        got = engine_devices(cfg, rank, 8, {**env, "LOCAL_RANK": str(rank % 4)}, source=rank % 4 == 0)
        assert got == written.get(rank, []), rank


def test_fit_nodes_refuses_ranks_that_do_not_fill_whole_nodes():
    six = replace(H100, gpus_per_node=6, gpu_numa_nodes=[])  # colocated 8 ranks of qwen2.5-14b on 6-GPU nodes
    with pytest.raises(LaunchConfigError, match=r"the 8 trainer ranks of preset qwen2\.5-14b \(TP=4, PP=1\) do not fill "
                                                r"whole nodes of 6 GPUs \(6 ranks each\)"):
        render("megatron_kto_factalign", load_site_stage("megatron_kto_factalign", ["fit_nodes=true"]), six)


# ------------------------------------------------------------------------------------------------ checkpoints
def test_ckpt_dir_comes_from_the_profile_and_a_lost_one_is_refused_in_one_line(tmp_path):
    """Before: every stage checkpointed to /lustre/checkpoints/<stage> whatever the profile mounted, silently."""
    params = site_params("grpo_klcf")
    res = _cli(tmp_path, "grpo_klcf", "--dry-run", *params, "cluster.container_mounts=[/scratch:/scratch]")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and res.stdout == "", res.stderr
    assert ("ckpt_dir=/lustre/checkpoints/grpo_klcf is not under any of the profile's container_mounts (/scratch:/scratch)"
            ": the step would write its checkpoints into the container's own filesystem") in lines[0]
    assert "set cluster.ckpt_root (or ckpt_dir=)" in lines[0] and list(tmp_path.iterdir()) == []
    res = _cli(tmp_path, "grpo_klcf", "--dry-run", "--out", "x.sbatch", *params,
               "cluster.container_mounts=[/scratch:/scratch]", "cluster.ckpt_root=/scratch/ckpt")
    assert res.returncode == 0, res.stderr
    assert "exp_manager.explicit_log_dir=/scratch/ckpt/grpo_klcf" in res.stdout
    res = _cli(tmp_path, "grpo_klcf", "--dry-run", "--out", "x.sbatch", *params, "cluster.container_mounts=[/lustre:/lustre:ro]")
    assert res.returncode == 2 and "is under the read-only container mount /lustre:/lustre (:ro)" in res.stderr


def test_the_batch_script_reads_the_requeue_file_at_its_host_path(tmp_path):
    """A mount that maps another host path (/lustre/u/me/ckpt:/ckpt): the trainer writes /ckpt/<stage>/REQUEUE in its
    container, the batch script on the host reads it under /lustre/u/me/ckpt (run here with bash: it requeues)."""
    host = tmp_path / "lustre" / "u" / "me" / "ckpt"
    cluster = replace(H100, container_mounts=[f"{host}:/ckpt", "/models:/models"], ckpt_root="/ckpt")
    text = render("grpo_fspo", load_site_stage("grpo_fspo"), cluster)
    assert "export CKPT_DIR=/ckpt/grpo_fspo" in text and f"CKPT_HOST_DIR={host}/grpo_fspo" in text
    assert "exp_manager.explicit_log_dir=/ckpt/grpo_fspo" in text
    (host / "grpo_fspo").mkdir(parents=True)
    (host / "grpo_fspo" / "REQUEUE").write_text("judge gone past its retry window\n")
    requeue = text.split("after_trainer() {", 1)[1].split("\n}\n", 1)[0]
    script = (f"CKPT_HOST_DIR={host}/grpo_fspo RESTARTS=0 MAX_RESTARTS=5 SLURM_JOB_ID=7\n"
              "scontrol() { echo \"scontrol $*\"; }\nafter_trainer() {" + requeue + "\n}\nafter_trainer 1 trainer\n")
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "judge gone past its retry window" in res.stdout, res.stdout + res.stderr
    assert "scontrol requeue 7" in res.stdout and not (host / "grpo_fspo" / "REQUEUE").exists()


# ------------------------------------------------------------------------------------------------ ports
@pytest.mark.parametrize("stage_name", ["grpo_klcf", "aligner_ppo_rlfh", "cpu_standin_klcf"])
def test_two_jobs_listen_on_ports_of_their_own_and_clients_follow(stage_name):
    """Before: every job of a stage listened on the same fixed ports (5555..., 8000-8043), so two sharing a node
    collided. Each job's ports (the script's own exports, run with bash) are disjoint from the next job's, and every
    server's command binds the ports its URL and health check point at."""
    cluster = "local_cpu" if stage_name.startswith("cpu_") else "h100_pyxis"
    text = rendered(stage_name, cluster)
    jobs = [job_variables(text, job_id) for job_id in (123456, 123457, 123458)]
    taken = [{int(v) for k, v in job.items() if k.endswith("_PORT")} for job in jobs]
    assert all(taken) and not (taken[0] & taken[1]) and not (taken[1] & taken[2]) and not (taken[0] & taken[2])
    profile = load_config(ClusterProfile, cluster, group="cluster")
    assert all(profile.port_range[0] <= p < profile.port_range[1] for ports in taken for p in ports)
    job = jobs[0]
    for line, command in srun_steps(text):
        env = re.search(r'--nodelist="\$\{(\w+)_NODE\}"', line) or re.search(r"--het-group=(3) ", line)
        if env is None:
            continue
        name = "CRITIC" if env.group(1) == "3" else env.group(1)
        port = job[f"{name}_URL"].rsplit(":", 1)[1]
        bound = expand(command, job)
        assert re.search(rf"(--port |http_port=|critic\.port=){port}\b", bound), (name, bound)
        if f"{name}_HEALTH_PORT" in job:
            assert f"health_port={job[f'{name}_HEALTH_PORT']}" in bound
    readiness = [expand(line, job) for line in text.splitlines() if line.startswith("wait_ready ")]
    assert all(re.search(r'"http://[\w.]+:(\d+)/', line).group(1) in {str(p) for p in taken[0]} for line in readiness)


def test_a_port_written_as_a_number_or_a_default_port_is_refused():
    stage = load_site_stage("grpo_klcf")
    stage.judges[0].command = stage.judges[0].command.replace("{port}", "5590")
    stage.reward_servers[0].command = stage.reward_servers[0].command.replace(" grpc_port={grpc_port}", "")
    with pytest.raises(LaunchConfigError) as err:
        render("grpo_klcf", stage, H100)
    assert "server 'extractor''s command names its port 5590 as a number: write {port}" in str(err.value)
    assert ("server 'factuality_reward' runs nemo-factuality serve without grpc_port: it would bind the fixed default(s)"
            " on a node another job may share; pass grpc_port={grpc_port}") in str(err.value)
    with pytest.raises(LaunchConfigError, match=r"the stage's ports span 5555-5597, more than cluster\.port_range"):
        render("grpo_klcf", load_site_stage("grpo_klcf"), replace(H100, port_range=[10000, 10020]))


# ------------------------------------------------------------------------------------------------ srun flags
@pytest.mark.parametrize("stage_name", [s for s in STAGES if not s.startswith("cpu_")])
def test_every_srun_line_asks_its_cpus_and_gpu_ranks_are_bound_to_their_numa_node(stage_name):
    """Before: --cpus-per-task was on the #SBATCH lines only (srun 22.05-23.02 does not inherit it: each task got one
    CPU) and no rank was bound. Every step asks the profile's 16; the trainer and critic (one task per GPU, every GPU
    of the node) get --gpu-bind=none and their GPU's NUMA node from the profile (GPUs 0-3: 0, 4-7: 1)."""
    text = rendered(stage_name)
    lines = [line for line in text.splitlines() if line.startswith("srun ")]
    assert lines and all(" --cpus-per-task=16 " in line for line in lines)
    stage = load_site_stage(stage_name)
    for line in lines:
        per_gpu = "--kill-on-bad-exit=1" in line  # the preset trainers and the critic
        tasks = int(re.search(r"--ntasks-per-node=(\d+)", line).group(1)) if per_gpu else 0
        numa = ",".join(["0"] * min(tasks, 4) + ["1"] * max(tasks - 4, 0))
        assert ("--gpu-bind=none" in line) == per_gpu, line
        assert (f" --cpu-bind=map_ldom:{numa} --mem-bind=local" in line) == per_gpu, line
    assert stage.preset or "--gpu-bind" not in text  # the hf trainer: one process on the one GPU Slurm gives it
