"""What a rendered job needs to run as rendered: required params, every endpoint of the served rewards wired to a
server of the job under the model name it asks for, each step's image, GPUs split between a node's servers,
NCCL's tree algorithm on the cluster profile. All checked on the rendered text or at render time (no Slurm)."""

from __future__ import annotations

import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from launch_helpers import expand, job_variables, load_site_stage, rendered, srun_steps
from omegaconf import OmegaConf

from nemo_factuality.cli import main as cli
from nemo_factuality.config import REPO_ROOT, load_config
from nemo_factuality.launch.config import ClusterProfile, LaunchConfig, ServerSpec
from nemo_factuality.launch.render import LaunchConfigError, place, render
from nemo_factuality.launch.wiring import serve_invocation
from nemo_factuality.serving.config import ServeConfig

STAGES = sorted(p.stem for p in (REPO_ROOT / "conf" / "launch").glob("*.yaml"))
GPU_STAGES = [s for s in STAGES if not s.startswith("cpu_")]
H100 = load_config(ClusterProfile, "h100_pyxis", group="cluster")


def _cluster(name: str) -> str:
    return "local_cpu" if name.startswith("cpu_") else "h100_pyxis"


# ------------------------------------------------------------------------------------------------ params
@pytest.mark.parametrize("stage_name", [s for s in STAGES if load_config(LaunchConfig, s, group="launch").params])
def test_required_params_are_refused_in_one_line(stage_name, tmp_path, monkeypatch, capsys):
    """A new user's first dry run: one line naming every empty key and how to set it, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    required = [k for k, v in load_config(LaunchConfig, stage_name, group="launch").params.items() if v is None]
    assert required
    assert cli(["launch", stage_name, "--cluster", _cluster(stage_name), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"nemo-factuality launch: error: {stage_name} needs params.")
    assert f"nemo-factuality launch {stage_name} " + " ".join(f"params.{k}=..." for k in required) in err
    assert list(tmp_path.iterdir()) == []
    if len(required) > 1:  # one key set on the command line: the others are still named, it is not
        assert cli(["launch", stage_name, "--cluster", _cluster(stage_name), "--dry-run", f"params.{required[0]}=/x"]) == 2
        err = capsys.readouterr().err
        assert f"params.{required[0]}" not in err and f"params.{required[1]}" in err


def test_placeholders_and_params_must_match():
    stage = load_site_stage("grpo_klcf")
    stage.trainer_command = stage.trainer_command.replace("{policy_model}", "{policy_modle}")
    stage.params["unused"] = "/x"
    with pytest.raises(LaunchConfigError) as err:
        render("grpo_klcf", stage, H100)
    assert "trainer_command uses {policy_modle}: not a params key" in str(err.value)
    assert "params.unused is set but no command uses {unused}" in str(err.value)


def test_param_values_are_quoted_for_the_shell():
    stage = load_site_stage("grpo_klcf")
    stage.params["train_data"] = "/data/my prompts.jsonl"
    command = srun_steps(render("grpo_klcf", stage, H100))[-1][1]
    assert "data.train='/data/my prompts.jsonl'" in command  # one word for the trainer


# ------------------------------------------------------------------------------------------------ endpoints
def _server_urls(variables: dict[str, str]) -> dict[str, str]:
    """Server env prefix -> its URL, as the script's host discovery exports it."""
    return {k.removesuffix("_URL"): v for k, v in variables.items() if k.endswith("_URL")}


def _endpoints(node, prefix="reward"):
    if isinstance(node, dict):
        if "base_url" in node or "url" in node:
            yield prefix, node
        for key, value in node.items():
            yield from _endpoints(value, f"{prefix}.{key}")


@pytest.mark.parametrize("stage_name", STAGES)
def test_every_endpoint_of_a_served_reward_is_a_server_of_the_job(stage_name):
    """Read back from the script: each `nemo-factuality serve` loads its config with the rendered overrides (the
    URL variables as the job exports them), and every endpoint block it then uses is a server this job starts,
    which answers under the model name the block asks for (vLLM's --served-model-name)."""
    text = rendered(stage_name, _cluster(stage_name))
    variables = job_variables(text)
    urls = _server_urls(variables)
    steps = [(line, expand(command, variables)) for line, command in srun_steps(text)]
    served_names = {}
    for line, command in steps:
        env = re.search(r'--nodelist="\$\{(\w+)_NODE\}"', line)
        name = re.search(r"--served-model-name (\S+)", command)
        if env and name:
            served_names[urls[env.group(1)]] = name.group(1)
    checked = 0
    for _, command in steps:
        invocation = serve_invocation(command)
        if invocation is None:
            continue
        config_name, overrides = invocation
        reward = asdict(load_config(ServeConfig, config_name, overrides, group="serve"))["reward"]
        shared_model = (reward.get("judge") or {}).get("model")
        for key, block in _endpoints(reward):
            url = block.get("url") or block["base_url"]
            server = url.removesuffix("/v1")
            assert server in urls.values(), f"{stage_name}: {key} -> {url} is no server of the job"
            assert "127.0.0.1" not in url
            if "base_url" in block:
                assert url.endswith("/v1") and served_names[server] == (block.get("model") or shared_model), key
            checked += 1
    configs = [serve_invocation(c) for _, c in steps if serve_invocation(c)]
    expected = sum(len(list(_endpoints(OmegaConf.to_container(OmegaConf.load(REPO_ROOT / "conf" / "serve" / f"{n}.yaml"))["reward"])))
                   for n, _ in configs)
    assert checked == expected  # every endpoint block of the shipped configs was looked at


def test_klcf_wires_its_four_roles_to_four_servers():
    text = rendered("grpo_klcf")
    reward_command = next(c for _, c in srun_steps(text) if "--config-name klcf" in c)
    for key, server in (("reward.judge.base_url", "EXTRACTOR"), ("reward.pipeline.extractor.judge.base_url", "EXTRACTOR"),
                        ("reward.checklist_judge.base_url", "CHECKLIST"),
                        ("reward.pipeline.verifier.judge.base_url", "TRUTHFULNESS")):
        assert f"{key}=${{{server}_URL}}/v1" in reward_command.split()
    assert "reward.general_rm.url=${GENERAL_RM_URL}" in reward_command.split()
    assert "policy_tokenizer=/site/policy_model" in reward_command.split()


def _klcf_with(**changes) -> LaunchConfig:
    stage = load_site_stage("grpo_klcf")
    for name, fields in changes.items():
        judge = next(j for j in stage.judges if j.name == name)
        for key, value in fields.items():
            setattr(judge, key, value)
    return stage


@pytest.mark.parametrize("changes,message", [
    ({"truthfulness": {"serves": []}}, r"reward\.pipeline\.verifier\.judge\.base_url = http://127\.0\.0\.1:8002/v1 is served "
                                       r"by no het group of the job: add reward\.pipeline\.verifier\.judge to the serves:"),
    ({"general_rm": {"serves": []}}, r"reward\.general_rm\.url = http://127\.0\.0\.1:8003 is served by no het group"),
    ({"checklist": {"serves": ["reward.checklist_judge", "reward.info_judge"]}},
     r"server 'checklist' serves reward\.info_judge, which no reward server's config has"),
    ({"checklist": {"serves": ["reward.checklist_judge", "reward.judge"]}},
     r"reward\.judge is in the serves: of both 'extractor' and 'checklist'"),
    ({"checklist": {"serves": ["reward.checklist_judge", "reward.pipeline.verifier.judge"]},
      "truthfulness": {"serves": []}}, r"server 'checklist' serves blocks asking for different models"),
    ({"extractor": {"command": "vllm serve {extractor_model} --served-model-name extractor --port {port}"}},
     r"server 'extractor' runs --served-model-name extractor but the reward asks for model 'KLCF-Qwen2\.5-14B-Claim-Extractor'"),
    ({"extractor": {"command": "vllm serve {extractor_model} --port {port}"}},
     r"server 'extractor' runs vllm serve without --served-model-name"),
])
def test_an_unwired_endpoint_is_an_error_naming_its_key(changes, message):
    with pytest.raises(LaunchConfigError, match=message):
        render("grpo_klcf", _klcf_with(**changes), H100)


def test_the_reward_servers_serve_invocation_is_read_as_the_server_reads_it():
    assert serve_invocation("a --x && exec nemo-factuality serve --config-name klcf http_port=1 'k=v w'") == \
        ("klcf", ["http_port=1", "k=v w"])
    assert serve_invocation("nemo-factuality serve --config-name=demo") == ("demo", [])
    assert serve_invocation("vllm serve /m --port 1") is None
    with pytest.raises(ValueError, match="must end with the `nemo-factuality serve"):
        serve_invocation("nemo-factuality serve --config-name klcf; echo done")


# ------------------------------------------------------------------------------------------------ images
@pytest.mark.parametrize("stage_name", GPU_STAGES)
def test_judges_run_the_judge_image_and_everything_else_the_trainer_image(stage_name):
    """... except a megatron-backend trainer, which runs the megatron image (Megatron-Core 0.16 + Bridge + vLLM)."""
    for line, command in srun_steps(rendered(stage_name)):
        image = re.search(r"--container-image=(\S+)", line).group(1)
        megatron_trainer = line.startswith("srun --het-group=0 ") and "trainer.backend=megatron" in command
        want = "judge" if re.search(r"(^|\s)vllm serve", command) else "megatron" if megatron_trainer else "trainer"
        assert image == H100.images[want], line


def test_images_are_checked_against_the_profile():
    with pytest.raises(LaunchConfigError, match=r"server 'extractor' runs vllm in the 'trainer' image, which has no vLLM"):
        render("grpo_klcf", _klcf_with(extractor={"image": "trainer"}), H100)
    with pytest.raises(LaunchConfigError, match=r"server 'extractor' runs image 'vllm', which the profile's images "
                                                r"\(judge, megatron, trainer\) do not have"):
        render("grpo_klcf", _klcf_with(extractor={"image": "vllm"}), H100)
    with pytest.raises(LaunchConfigError, match=r"the profile's images have no 'trainer'"):
        render("grpo_fspo", load_site_stage("grpo_fspo"), replace(H100, images={"judge": "/x.sqsh"}))
    without = {k: v for k, v in H100.images.items() if k != "megatron"}
    with pytest.raises(LaunchConfigError, match=r"the profile's images have no 'megatron' \(the trainer's; "
                                                r"`docker build --target megatron \.`\)"):
        render("megatron_grpo_fspo", load_site_stage("megatron_grpo_fspo"), replace(H100, images=without))


# ------------------------------------------------------------------------------------------------ GPUs
def test_place_splits_a_nodes_gpus_first_fit():
    specs = [ServerSpec(gpus=g) for g in (4, 4, 2, 0, 7, 1)]
    assert place(specs, 8) == [(0, (0, 1, 2, 3)), (0, (4, 5, 6, 7)), (1, (0, 1)), (0, ()), (2, tuple(range(7))),
                               (1, (2,))]
    assert place([ServerSpec(), ServerSpec()], 0) == [(0, ()), (0, ())]


def test_two_tp4_judges_share_a_node_each_with_its_own_gpus():
    """KLCF's three 14B judges at TP=4 and the 1-GPU general RM on 8-GPU nodes: two judges per node, split."""
    stage = _klcf_with(extractor={"gpus": 4}, checklist={"gpus": 4}, truthfulness={"gpus": 4})
    text = render("grpo_klcf", stage, H100)
    assert "#SBATCH --nodes=2 --ntasks-per-node=2 --gpus-per-node=8 " in text  # the judge group
    commands = {re.search(r'--nodelist="\$\{(\w+)_NODE\}"', line).group(1): c for line, c in srun_steps(text)
                if "--het-group=2 " in line}
    assert commands["EXTRACTOR"].startswith("export CUDA_VISIBLE_DEVICES=0,1,2,3; vllm serve /site/extractor_model ")
    assert commands["CHECKLIST"].startswith("export CUDA_VISIBLE_DEVICES=4,5,6,7; vllm serve /site/checklist_model ")
    assert commands["TRUTHFULNESS"].startswith("export CUDA_VISIBLE_DEVICES=0,1,2,3; ")
    assert commands["GENERAL_RM"].startswith("export CUDA_VISIBLE_DEVICES=4; nemo-factuality serve")
    assert "--tensor-parallel-size 4 " in commands["EXTRACTOR"] and "--port ${EXTRACTOR_PORT}" in commands["EXTRACTOR"]
    assert "--port ${CHECKLIST_PORT}" in commands["CHECKLIST"]
    nodes = dict(re.findall(r'^(\w+)_NODE=\$\(nth_node "\$\{SLURM_JOB_NODELIST_HET_GROUP_2\}" (\d)\)$', text, re.MULTILINE))
    assert nodes == {"EXTRACTOR": "0", "CHECKLIST": "0", "TRUTHFULNESS": "1", "GENERAL_RM": "1"}


def test_a_node_cannot_be_oversubscribed():
    with pytest.raises(LaunchConfigError, match=r"server 'extractor' asks for 9 GPUs; nodes have 8"):
        render("grpo_klcf", _klcf_with(extractor={"gpus": 9}), H100)
    with pytest.raises(LaunchConfigError, match=r"servers 'extractor' and 'checklist' share a node and port 5590"):
        render("grpo_klcf", _klcf_with(checklist={"port": 5590}), H100)
    with pytest.raises(LaunchConfigError, match=r"server 'extractor' has nodes=2: a reward server or judge is one task"):
        render("grpo_klcf", _klcf_with(extractor={"nodes": 2}), H100)


def test_a_cpu_only_server_beside_gpu_servers_sees_no_gpu():
    stage = load_site_stage("grpo_klcf")
    stage.judges[3].gpus = 0  # the general RM on CPU, on the vLLM judges' node
    commands = [c for line, c in srun_steps(render("grpo_klcf", stage, H100)) if "--het-group=2 " in line]
    assert commands[3].startswith("export CUDA_VISIBLE_DEVICES=; nemo-factuality serve --config-name general_rm")


# ------------------------------------------------------------------------------------------------ NCCL
def test_the_gpu_profile_asks_nccl_for_tree_all_reduce():
    """NeMo-Aligner's advice for log-probs that agree between forward passes: exported before any step starts, and
    every srun passes the environment on (no --export=NONE)."""
    assert H100.env["NCCL_ALGO"] == "Tree"
    text = rendered("aligner_ppo_rlfh")
    assert text.index("export NCCL_ALGO=Tree") < text.index("\nsrun ")
    assert all("--export=" not in line or "--export=ALL," in line for line, _ in srun_steps(text))
    assert "NCCL_ALGO" not in Path(REPO_ROOT / "conf" / "cluster" / "local_cpu.yaml").read_text()


def test_fake_judge_answers_only_its_served_model_name():
    """The stand-in's judges refuse another model name as vLLM does, so a mis-wired role fails, not passes."""
    import httpx

    from nemo_factuality.testing.fake_openai import ScriptedOpenAIServer

    with ScriptedOpenAIServer(default="ok", model="KLCF-Extractor", require_model=True) as server:
        ok = httpx.post(f"{server.url}/chat/completions", json={"model": "KLCF-Extractor", "messages": [{"role": "user", "content": "x"}]})
        wrong = httpx.post(f"{server.url}/chat/completions", json={"model": "judge", "messages": [{"role": "user", "content": "x"}]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"
    assert wrong.status_code == 404 and "`judge` does not exist" in wrong.json()["message"]
