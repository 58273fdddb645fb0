"""The 7B–32B megatron presets (``conf/train/megatron/``): every memory and checkpoint line written next to them is
what ``backends.megatron.memory`` computes from the preset's own stage overrides, every GPU (trainer and vLLM engine,
as placed) fits an H100-80GB's budget, the layouts are ones Megatron and the placement accept, the placement is stated
with its reason, and ``--preset`` gives the stage exactly those settings (refusing another backend's preset)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from nemo_factuality import placement
from nemo_factuality.config import REPO_ROOT, ConfigError
from nemo_factuality.trainers import config as schemas
from nemo_factuality.trainers.backends.megatron import memory as mm
from nemo_factuality.trainers.backends.memory import GIB, H100_BUDGET_GIB, Arch
from nemo_factuality.trainers.parallel import data_parallel_problems
from nemo_factuality.trainers.presets import load_preset

PRESETS = sorted((REPO_ROOT / "conf" / "train" / "megatron").glob("*.yaml"))
METHODS = ("grpo", "ppo", "kto")
PUBLISHED = {"7b": 7.62, "14b": 14.77, "32b": 32.76}  # billions of parameters
STAGES = {"grpo": ("GRPOConfig", "klcf"), "ppo": ("PPOConfig", "rlfh"), "kto": ("KTOConfig", "factalign")}


def _preset(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_all_six_models_have_a_preset_of_each_backend():
    names = {f"{f}-{s}" for f in ("qwen2.5", "deepseek-r1-distill-qwen") for s in ("7b", "14b", "32b")}
    assert {p.stem for p in PRESETS} == names
    assert {p.stem for p in (REPO_ROOT / "conf" / "train" / "aligner").glob("*.yaml")} == names


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_each_sections_memory_and_checkpoint_lines_are_the_arithmetic(path):
    """Verbatim: a changed formula, batch, layout or engine share that is not written back fails here."""
    text, preset = path.read_text(), _preset(path)
    for method in METHODS:
        section = text.split(f"\n{method}:\n", 1)[1].split("\n  overrides:", 1)[0]
        written = [line.removeprefix("  # ") for line in section.splitlines()
                   if line.startswith("  # ") and line[4:].startswith(("train:", "logprobs", "save", "  host", "engine", "  KV", "per GPU",
                                                                       "checkpoint"))]
        assert written == mm.section_lines(mm.plan(preset, method), method), (path.stem, method)


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_each_method_fits_an_h100_and_megatron_accepts_its_layout(path):
    preset = _preset(path)
    arch = Arch(**preset["arch"])
    assert arch.parameters() / 1e9 == pytest.approx(PUBLISHED[path.stem.rsplit("-", 1)[1]], abs=0.01)
    for method in METHODS:
        p = mm.plan(preset, method)
        lay, eng = p.layout, p.engine
        peaks = mm.gpu_peaks(p)
        assert max(peaks.values()) / GIB <= H100_BUDGET_GIB, (method, peaks)
        # a save's host memory, and the fully reshardable save a TP/PP change needs first, fit a node
        assert mm.save_bytes(p)["host_node"]["total"] / GIB <= mm.layout_change_host_bytes(p) / GIB <= mm.HOST_BUDGET_GIB
        assert p.layout.forward_micro_batch <= mm.largest_forward_micro_batch(p), method  # the forward batch was sized to fit
        engine = mm.engine_bytes(arch, eng)
        assert engine["kv_cache"] > 0 and engine["sequences"] >= mm.MIN_ENGINE_SEQUENCES, (method, engine)
        # Megatron: heads and KV heads split over TP, the vocabulary too; vLLM the same over its TP
        for tp in (lay.tp, eng.tp):
            assert arch.heads % tp == 0 and (arch.kv_heads % tp == 0 or tp % arch.kv_heads == 0) and arch.vocab % tp == 0
        assert lay.sequence_parallel and lay.tp > 1  # SP needs TP > 1
        assert not placement.layout_problems(eng.placement, tasks_per_node=p.tasks_per_node, gpus_per_node=8,
                                             tensor=lay.tp, pipeline=lay.pp, engine_tp=eng.tp), method
        assert (p.nodes * p.tasks_per_node) % (lay.tp * lay.pp) == 0 and lay.dp >= 1
        merged = _merged(preset, method)
        m = merged["model"]
        assert eng.seq_len == merged["data"]["max_prompt_tokens"] + m["length_params"]["max_length"] == lay.seq_len
        algo = merged[method]
        prompts = algo.get("num_prompts_per_step", algo.get("prompts_per_iteration"))
        per_prompt = algo.get("num_rollouts_per_prompt", 1) if method != "kto" else None
        key = f"{method}.{'prompts_per_iteration' if method == 'kto' else 'num_prompts_per_step'}"
        other = {"critic.micro_batch_size": merged["critic"]["micro_batch_size"]} if method == "ppo" else {}
        assert not data_parallel_problems(lay.dp, key, prompts, per_prompt, m["global_batch_size"], m["micro_batch_size"],
                                          other_micro_batch_sizes=other)
        if method == "ppo":  # the critic's step keeps the policy's activations without the logits: below its peak
            assert merged["critic"]["micro_batch_size"] <= m["micro_batch_size"]


def _merged(preset: dict, method: str) -> dict:
    from nemo_factuality.config import merge_tree

    return merge_tree(preset["common"], preset[method]["overrides"])


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_each_preset_states_its_placement_and_why(path):
    text, preset = path.read_text(), _preset(path)
    stated = re.search(r"^# Placement: (\w+) \(rollout\.vllm\.placement\)\. Why: (.{40,})$", text, re.MULTILINE)
    assert stated, path.stem
    assert all(_merged(preset, m)["rollout"]["vllm"]["placement"] == stated.group(1) for m in METHODS)
    assert all(_merged(preset, m)["rollout"]["engine"] == "vllm" for m in METHODS)


def test_the_placements_differ_where_the_arithmetic_says_so():
    """The R1-distill 7B's 9k-token traces: a colocated engine's share would hold far fewer traces than a separate
    engine, which is the reason its preset gives; the 32B replicas fill their nodes, so theirs are colocated."""
    r1 = _preset(REPO_ROOT / "conf" / "train" / "megatron" / "deepseek-r1-distill-qwen-7b.yaml")
    separate = mm.plan(r1, "grpo")
    colocated = mm.plan({**r1, "common": _merged(r1, "grpo") | {"rollout": {"engine": "vllm", "vllm": {
        "placement": "colocated", "tensor_parallel_size": 2, "gpu_memory_utilization": 0.25}}}}, "grpo")
    assert (mm.engine_bytes(colocated.arch, colocated.engine)["sequences"], mm.engine_bytes(separate.arch, separate.engine)[
        "sequences"]) == (43, 219)  # the numbers its "Why" quotes
    assert "holds 43 traces at once" in (r1_text := (REPO_ROOT / "conf/train/megatron/deepseek-r1-distill-qwen-7b.yaml").read_text())
    assert "(0.8 of each) 219" in r1_text.replace("\n# ", " ")
    for name in ("qwen2.5-32b", "deepseek-r1-distill-qwen-32b"):
        assert _merged(_preset(REPO_ROOT / f"conf/train/megatron/{name}.yaml"), "grpo")["model"][
            "tensor_model_parallel_size"] == 8


HAND = Arch(hidden=1024, layers=4, heads=8, kv_heads=2, ffn=2816, vocab=1000)  # head_dim 128


def test_the_new_terms_hand_computed():
    """Engine: 0.25 × 79 GiB share, weights 2 B × the n parameters a GPU holds at TP_e=2 (half the split ones, every
    norm whole), KV 2·4·⌈2/2⌉·128·2 = 2,048 B per token. Checkpoint: 2P + 12P (+2P KTO, +14·P_critic PPO), final/ 2P.
    Critic: P − V·h + h + 1. Log-prob forward logits: 14 B each."""
    p = HAND.parameters()
    eng = mm.engine_bytes(HAND, mm.Engine(tp=2, gpu_memory_utilization=0.25, placement="colocated", seq_len=512))
    norms = (2 * 4 + 1) * 1024  # two per layer and the final one
    n = (p - norms) // 2 + norms
    assert eng["total"] == 0.25 * 79 * GIB and eng["weights"] == 2 * n and eng["overhead"] == 2 * GIB
    assert eng["kv_cache"] == eng["total"] - eng["weights"] - 2 * GIB
    assert eng["sequences"] == int(eng["kv_cache"] // (2048 * 512))
    assert mm.critic_parameters(HAND) == p - 1000 * 1024 + 1024 + 1
    ckpt = mm.checkpoint_bytes(HAND, "ppo")
    assert (ckpt["weights"], ckpt["optimizer"], ckpt["reference"]) == (2 * p, 12 * p, 0)
    assert ckpt["critic"] == 14 * mm.critic_parameters(HAND) and ckpt["total"] == 14 * p + ckpt["critic"]
    assert mm.checkpoint_bytes(HAND, "kto")["total"] == 16 * p and ckpt["final"] == 2 * p
    preset = {"arch": HAND.__dict__, "nodes": 1, "gpus_per_node": 8,
              "common": {"model": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1,
                                   "reference": "copy", "megatron": {"use_distributed_optimizer": True,
                                                                     "sequence_parallel": True, "recompute": "full"}},
                         "rollout": {"vllm": {"placement": "separate", "tensor_parallel_size": 2,
                                              "gpu_memory_utilization": 0.5}},
                         "data": {"max_prompt_tokens": 16}},
              "grpo": {"overrides": {"model": {"micro_batch_size": 1, "forward_micro_batch_size": 3,
                                               "length_params": {"max_length": 48}}}}}
    plan = mm.plan(preset, "grpo")
    assert (plan.tasks_per_node, plan.layout.dp, plan.layout.seq_len) == (4, 2, 64)  # 2 replicas + 2 engines of 2 GPUs
    forward = mm.trainer_bytes(plan)["logprobs"]
    assert forward["logits"] == 14 * 64 * 3 * 1000 / 2 and forward["reference"] == 2 * n  # model.reference=copy
    # a separate engine's GPU: its share, 0.5 × 79 GiB, and its process's CUDA context on top, 0.8 GiB (issue 50)
    assert mm.gpu_peaks(plan) == {"trainer": max(mm.trainer_bytes(plan)[k]["total"] for k in ("train", "logprobs")),
                                  "engine": 0.5 * 79 * GIB + 0.8 * GIB}
    # a save (dp_reshardable, TP = 2, DP = 2) of the n parameters a GPU holds: on the GPU weights 2n + grads 4n + Adam
    # 12n/2 + the reference 2n + 4 GiB; on a first DP rank's host its writes staged, weights 2n + Adam 6n; 4 ranks a
    # node; fully_reshardable adds 24n
    save = mm.save_bytes(plan)
    assert save["gpu"]["total"] == 14 * n + 4 * GIB and save["host"] == {"staged": 8 * n, "total": 8 * n}
    assert save["host_node"]["total"] == 32 * n and mm.layout_change_host_bytes(plan) == 4 * (8 * n + 24 * n)


def test_the_format_saved_before_did_not_fit_the_32b_presets_first_checkpoint():
    """Why the presets save in dp_reshardable: Megatron's fully_reshardable (default variant) all-gathers each state of
    the TP·PP shard on every GPU — a receive buffer of 4n beside the 4n/DP it sends, one state at a time (n: the
    parameters a GPU holds, about P/(TP·PP)). On
    qwen2.5-32b's GRPO that is 84.5 GiB on a GPU with the engine's share (budget 67.1); the save counted now is the
    resident states alone."""
    p = mm.plan(_preset(REPO_ROOT / "conf" / "train" / "megatron" / "qwen2.5-32b.yaml"), "grpo")
    n, dp = p.arch.stage_parameters(p.layout.tp, p.layout.pp), p.layout.dp
    share = mm.engine_bytes(p.arch, p.engine)["total"]
    resident = 2 * n + 4 * n + 12 * n / dp + 4 * GIB  # the reference is on the host (cpu_weight_swap)
    assert round((resident + 4 * n + 4 * n / dp + share) / GIB, 1) == 84.5 > H100_BUDGET_GIB
    assert mm.save_bytes(p)["gpu"]["total"] == pytest.approx(resident, rel=1e-12)
    assert mm.gpu_peaks(p)["trainer"] / GIB <= H100_BUDGET_GIB


def test_the_critic_parameter_count_is_a_real_value_models():
    """``P − V·h + h + 1`` is what transformers' token-classification Qwen2 (the hf backend's critic) holds."""
    from transformers import AutoModelForTokenClassification, Qwen2Config

    arch = Arch(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=300)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=300, tie_word_embeddings=False, num_labels=1)
    critic = AutoModelForTokenClassification.from_config(cfg)
    assert sum(t.numel() for t in critic.parameters()) == mm.critic_parameters(arch)


def _docs_rows() -> list[list[str]]:
    text = (REPO_ROOT / "docs" / "cluster" / "megatron.md").read_text()
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(r"^\| `(qwen2\.5|deepseek-r1-distill-qwen)-\d+b` \|", line)]


def test_the_docs_presets_table_is_the_arithmetic():
    """docs/cluster/megatron.md: one row per preset and method — layout, placement, per-GPU peaks (GiB), a save's host
    memory per node (GiB) and checkpoint bytes (GB) — each cell recomputed here."""
    rows = _docs_rows()
    assert len(rows) == 6 * 3
    for name, method, layout, engine, trainer_gib, engine_gib, save_host_gib, ckpt_gb, final_gb in rows:
        preset = _preset(REPO_ROOT / "conf" / "train" / "megatron" / f"{name.strip('`')}.yaml")
        p = mm.plan(preset, method)
        peaks, ckpt = mm.gpu_peaks(p), mm.checkpoint_bytes(p.arch, method)
        assert layout == f"{p.nodes}×8, TP={p.layout.tp} PP={p.layout.pp} DP={p.layout.dp}", (name, method)
        assert engine == f"{p.engine.placement}, TP={p.engine.tp}, {p.engine.gpu_memory_utilization}", (name, method)
        assert float(trainer_gib) == round(peaks["trainer"] / GIB, 1)
        assert engine_gib == ("—" if p.engine.placement == "colocated" else f"{peaks['engine'] / GIB:.1f}")
        assert float(ckpt_gb) == round(ckpt["total"] / 1e9, 1) and float(final_gb) == round(ckpt["final"] / 1e9, 1)
        assert float(save_host_gib) == round(mm.save_bytes(p)["host_node"]["total"] / GIB, 1)


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_the_preset_overrides_load_into_each_stage_schema(path):
    """Every override is a key of the stage's schema, and the stage's validation accepts the whole preset."""
    preset = _preset(path)
    for method, (schema, config_name) in STAGES.items():
        overrides, runtime = load_preset("megatron", path.stem, method)
        site = ["model.path=/models/policy", "reward=null", "remote_rm.url=http://r:5555"]
        cfg = schemas.load_train_config(getattr(schemas, schema), config_name, [*overrides, *site])
        merged = _merged(preset, method)
        assert runtime == {} and cfg.trainer.backend == "megatron" and cfg.trainer.device == "cuda"
        assert cfg.model.dtype == "bfloat16" and cfg.model.reference == "cpu_weight_swap"
        mc = cfg.model.megatron
        assert (mc.use_distributed_optimizer, mc.sequence_parallel, mc.recompute, mc.transformer_engine) == \
            (True, True, "full", True)
        assert cfg.model.tensor_model_parallel_size == merged["model"]["tensor_model_parallel_size"]
        assert cfg.rollout.engine == "vllm" and cfg.rollout.vllm.placement == merged["rollout"]["vllm"]["placement"]
        # separate engines are streamed to (NCCL); colocated ones reload a file (broadcast would need CUDA IPC)
        assert cfg.rollout.vllm.refit == ("broadcast" if cfg.rollout.vllm.placement == "separate" else "file")
        assert cfg.rollout.vllm.max_model_len == cfg.data.max_prompt_tokens + cfg.model.length_params.max_length


def test_train_preset_reaches_the_megatron_stage_and_another_backends_is_refused(tmp_path):
    from nemo_factuality.trainers.cli import parse_stage_config

    base = ["--config-name", "klcf", "--preset", "qwen2.5-7b", "model.path=/models/policy", "reward=null",
            "remote_rm.url=http://r:5555"]
    cfg, _ = parse_stage_config("grpo", [*base, "trainer.backend=megatron"])  # the preset's GPU settings, validated
    mc = cfg.model.megatron
    assert cfg.model.dtype == "bfloat16" and (mc.sequence_parallel, mc.recompute, mc.transformer_engine) == \
        (True, "full", True)
    cpu = ["model.dtype=float32", "model.megatron.sequence_parallel=false", "model.megatron.recompute=none",
           "model.megatron.transformer_engine=false"]
    cfg, runtime = parse_stage_config("grpo", [*base, "trainer.backend=megatron", *cpu, "model.micro_batch_size=1"])
    assert runtime == {} and cfg.model.tensor_model_parallel_size == 2 and cfg.model.global_batch_size == 128
    assert cfg.model.micro_batch_size == 1  # the command line over the preset
    assert (cfg.rollout.vllm.placement, cfg.rollout.vllm.gpu_memory_utilization) == ("colocated", 0.25)
    with pytest.raises(ConfigError, match=r"^--preset qwen2\.5-7b: trainer\.backend=hf has no presets; "
                                          r"conf/train/aligner/qwen2\.5-7b\.yaml is an aligner-backend preset and "
                                          r"conf/train/megatron/qwen2\.5-7b\.yaml is a megatron-backend preset: add "
                                          r"trainer\.backend=aligner or trainer\.backend=megatron$"):
        parse_stage_config("grpo", base)
    with pytest.raises(ConfigError, match=r"--preset qwen3-8b: no megatron preset .*known: deepseek-r1-distill-qwen-14b"):
        parse_stage_config("grpo", [*base[:3], "qwen3-8b", *base[4:], "trainer.backend=megatron"])
