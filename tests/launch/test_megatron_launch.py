"""``nemo-factuality launch`` for the megatron backend: each ``megatron_*`` stage is sized as the trainer itself reads
its preset, runs the ``megatron`` image with one srun task per trainer GPU, and writes out the GPU split — the
trainer ranks' devices and each vLLM engine's ``CUDA_VISIBLE_DEVICES``, colocated and separate, TP > 1 engines — which
is what each rank computes at run time; layouts the nodes cannot hold are refused when rendering."""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
from launch_helpers import load_site_stage, rendered, site_value

from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig
from nemo_factuality.launch.render import LaunchConfigError, python_modules, render

STAGES = sorted(p.stem for p in (REPO_ROOT / "conf" / "launch").glob("megatron_*.yaml"))
H100 = load_config(ClusterProfile, "h100_pyxis", group="cluster")


def test_every_method_has_a_megatron_stage():
    assert STAGES == ["megatron_grpo_fspo", "megatron_grpo_klcf", "megatron_grpo_knowrl", "megatron_kto_factalign",
                      "megatron_ppo_rlfh"]


def _trainer_step(text: str) -> tuple[str, str]:
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("srun --het-group=0 "))
    return lines[i], lines[i + 1]


@pytest.mark.parametrize("stage_name", STAGES)
def test_the_job_is_sized_as_the_trainer_reads_its_preset(stage_name):
    """Nodes, trainer tasks per node and TP/PP from the trainer's own reading of the preset (``trainers.presets`` +
    ``backends.megatron.memory.plan``), not the launcher's; the image, the exports and the devices the tasks see."""
    import yaml

    from nemo_factuality.trainers.backends.megatron.memory import plan

    stage = load_config(LaunchConfig, stage_name, group="launch")
    method = python_modules(stage.trainer_command)[0].rsplit(".", 1)[-1]
    p = plan(yaml.safe_load((REPO_ROOT / "conf" / "train" / "megatron" / f"{stage.preset}.yaml").read_text()), method)
    text = rendered(stage_name)
    header = next(line for line in text.splitlines() if line.startswith("#SBATCH --nodes="))
    assert header.startswith(f"#SBATCH --nodes={p.nodes} --ntasks-per-node={p.tasks_per_node} --gpus-per-node=8 ")
    srun, command = _trainer_step(text)
    assert srun.startswith(f"srun --het-group=0 --nodes={p.nodes} --ntasks-per-node={p.tasks_per_node} --kill-on-bad-exit=1 "
                           f"--export=ALL,LOCAL_WORLD_SIZE={p.tasks_per_node},NEMO_FACTUALITY_VLLM_PYTHON="
                           f"{H100.vllm_python} ")
    assert f"--container-image={H100.images['megatron']} " in srun and "--container-workdir=" in srun
    assert f"TP={p.layout.tp}, PP={p.layout.pp}" in text  # the group's title
    assert command.lstrip().startswith("bash -c 'export CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7; python -m nemo_factuality.trainers.")
    words = command.split()
    assert words[words.index("--preset") + 1] == stage.preset and "trainer.backend=megatron" in words
    assert f"model.path={site_value('policy_model')}" in words
    # the rendezvous: the trainer group's first node, a port per job
    assert 'TRAINER_NODE=$(nth_node "${SLURM_JOB_NODELIST_HET_GROUP_0}" 0)' in text
    assert "export MASTER_ADDR MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))" in text
    assert text.index("export MASTER_ADDR") < text.index("srun --het-group=0 ")


def _split(text: str) -> list[str]:
    """The GPU split comment block of a rendered megatron job."""
    block = text.split("# ---------- GPU split per node", 1)[1].split("\n", 1)[1]
    return [line[2:] for line in block.splitlines() if line.startswith("# ")][:64]


def test_the_gpu_split_separate_engines_hand_written():
    """R1-Distill-7B (separate, TP=2 trainer, TP=2 engines): ranks 0-3 on GPUs 0-3, the engines on 4,5 and 6,7."""
    lines = _split(rendered("megatron_grpo_fspo"))
    assert lines[:6] == [
        "every trainer task sees CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 and trains on GPU <local rank> (LOCAL_RANK)",
        "vLLM engines (rollout.vllm.placement=separate, TP=2, gpu_memory_utilization=0.8):",
        "  one per model replica, started by its first rank, on GPUs of its own",
        "node 0: trainer ranks 0-3 on GPUs 0-3",
        "  engine of replica 0 (started by rank 0): CUDA_VISIBLE_DEVICES=4,5",
        "  engine of replica 1 (started by rank 2): CUDA_VISIBLE_DEVICES=6,7",
    ]


def test_the_gpu_split_colocated_tp4_and_tp8_engines_hand_written():
    ppo = _split(rendered("megatron_ppo_rlfh"))  # qwen2.5-7b PPO: TP=4 replicas, TP=4 engines on their GPUs
    assert ppo[3:6] == ["node 0: trainer ranks 0-7 on GPUs 0-7",
                        "  engine of replica 0 (started by rank 0): CUDA_VISIBLE_DEVICES=0,1,2,3",
                        "  engine of replica 1 (started by rank 4): CUDA_VISIBLE_DEVICES=4,5,6,7"]
    klcf = _split(rendered("megatron_grpo_klcf"))  # qwen2.5-32b: 2 nodes, a TP=8 replica and its TP=8 engine on each
    assert klcf[3:7] == ["node 0: trainer ranks 0-7 on GPUs 0-7",
                         "  engine of replica 0 (started by rank 0): CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7",
                         "node 1: trainer ranks 8-15 on GPUs 0-7",
                         "  engine of replica 1 (started by rank 8): CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7"]


def test_a_command_line_placement_resizes_the_job_and_its_split():
    """The trainer command's own rollout.vllm.* words win over the preset's, in the job as in the trainer: qwen2.5-14b
    (TP=4) with separate TP=2 engines holds one replica per node (4 GPUs + 2), two GPUs idle."""
    stage = load_config(LaunchConfig, "megatron_kto_factalign", group="launch")
    command = stage.trainer_command + " rollout.vllm.placement=separate rollout.vllm.tensor_parallel_size=2"
    text = rendered("megatron_kto_factalign", overrides=(f"trainer_command={command}",))
    assert "#SBATCH --nodes=1 --ntasks-per-node=4 --gpus-per-node=8 " in text
    assert _split(text)[3:5] == ["node 0: trainer ranks 0-3 on GPUs 0-3, 2 GPU(s) idle",
                                 "  engine of replica 0 (started by rank 0): CUDA_VISIBLE_DEVICES=4,5"]


@pytest.mark.parametrize("stage_name", STAGES)
def test_each_rank_gives_its_engine_the_gpus_the_job_writes_out(stage_name):
    """At run time every rank computes its engine's devices itself (``vllm_rollout.engine_devices``, from its rank,
    LOCAL_WORLD_SIZE and the CUDA_VISIBLE_DEVICES the job sets): the same GPUs as the rendered split, rank by rank."""
    import yaml

    from nemo_factuality.trainers.backends.megatron.memory import plan
    from nemo_factuality.trainers.engines.vllm_rollout import engine_devices

    stage = load_config(LaunchConfig, stage_name, group="launch")
    method = python_modules(stage.trainer_command)[0].rsplit(".", 1)[-1]
    p = plan(yaml.safe_load((REPO_ROOT / "conf" / "train" / "megatron" / f"{stage.preset}.yaml").read_text()), method)
    written = {}
    for line in _split(rendered(stage_name)):
        found = re.match(r"  engine of replica \d+ \(started by rank (\d+)\): CUDA_VISIBLE_DEVICES=([\d,]+)$", line)
        if found:
            written[int(found.group(1))] = found.group(2).split(",")
    cfg = SimpleNamespace(trainer=SimpleNamespace(device="cuda"),
                          model=SimpleNamespace(tensor_model_parallel_size=p.layout.tp,
                                                pipeline_model_parallel_size=p.layout.pp),
                          rollout=SimpleNamespace(vllm=SimpleNamespace(placement=p.engine.placement,
                                                                       tensor_parallel_size=p.engine.tp)))
    world = p.nodes * p.tasks_per_node
    tp_dp = p.layout.tp * p.layout.dp
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "LOCAL_WORLD_SIZE": str(p.tasks_per_node)}
    for rank in range(world):
        source = rank % p.layout.tp == 0 and rank < tp_dp  # Megatron's model-parallel group's lowest rank
        got = engine_devices(cfg, rank, world, {**env, "LOCAL_RANK": str(rank % p.tasks_per_node)}, source=source)
        assert got == written.get(rank, []), (stage_name, rank)
    assert len(written) == p.layout.dp  # one engine per replica


def test_the_jobs_log_says_the_engines_answer_a_health_check_before_step_1():
    text = rendered("megatron_grpo_klcf")
    echo = next(line for line in text.splitlines() if line.startswith('echo "[launch] trainer:'))
    assert "one vLLM engine per model replica (colocated) starts inside it and answers a health check before step 1" in echo
    assert "trainer.log: 'vLLM engine ready'" in echo  # what VLLMEngine.start logs once the engine answers
    assert text.index(echo) < text.index("srun --het-group=0 ")


@pytest.mark.parametrize("words, message", [
    ("rollout.vllm.tensor_parallel_size=8", "a colocated engine shares its replica's GPUs on one node, 4 here"),
    ("rollout.vllm.placement=separate model.pipeline_model_parallel_size=2",
     "rollout.vllm.placement=separate needs model.pipeline_model_parallel_size=1"),
    ("rollout.vllm.placement=separate rollout.vllm.tensor_parallel_size=8", "the node has 8"),
])
def test_a_placement_the_nodes_cannot_hold_is_refused_when_rendering(words, message):
    stage = load_config(LaunchConfig, "megatron_kto_factalign", group="launch")
    with pytest.raises(LaunchConfigError, match=re.escape(message)):
        rendered("megatron_kto_factalign", overrides=(f"trainer_command={stage.trainer_command} {words}",))


def test_bare_metal_needs_the_engines_interpreter_and_a_preset_stage_its_backend():
    bare = replace(H100, images={}, container_mounts=[], vllm_python=None)
    with pytest.raises(LaunchConfigError, match=r"rollout\.engine=vllm\) but cluster\.vllm_python is unset and the "
                                                r"profile has no images"):
        render("megatron_grpo_fspo", load_site_stage("megatron_grpo_fspo"), bare)
    assert "NEMO_FACTUALITY_VLLM_PYTHON=/opt/vllm/bin/python" in render(
        "megatron_grpo_fspo", load_site_stage("megatron_grpo_fspo"), replace(bare, vllm_python="/opt/vllm/bin/python"))
    stage = load_config(LaunchConfig, "megatron_grpo_fspo", group="launch")
    with pytest.raises(LaunchConfigError, match=r"trainer_command must name trainer\.backend=aligner"):
        # without the word, the preset is looked up as an aligner one (the stages' meaning before megatron presets)
        rendered("megatron_grpo_fspo", overrides=(
            f"trainer_command={stage.trainer_command.replace('trainer.backend=megatron', '')}",))


def test_the_profiles_vllm_python_is_the_megatron_images():
    """The Dockerfile's megatron stage puts vLLM's interpreter where the profile says (ENV NEMO_FACTUALITY_VLLM_PYTHON)."""
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert f"ENV NEMO_FACTUALITY_VLLM_PYTHON={H100.vllm_python}" in dockerfile
    assert "FROM ${MEGATRON_BASE_IMAGE} AS megatron" in dockerfile and H100.images["megatron"].endswith("megatron.sqsh")
