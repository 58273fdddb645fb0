"""``rollout.engine: megatron | trtllm``: the config plumbing into NeMo-Aligner's ``reinforce.trt_llm`` section and
the start-up refusal where TensorRT-LLM cannot run (here: no tensorrt_llm, no GPU). The engine itself (build,
refit after every update, rebuild after a checkpoint load) runs only in the NeMo-Aligner container."""

from __future__ import annotations

import re

import pytest

from nemo_factuality.testing.training import write_jsonl
from nemo_factuality.trainers.backends.aligner.actor import AlignerRuntime, model_overrides, trt_llm_section
from nemo_factuality.trainers.config import GRPOConfig, load_train_config


def test_trtllm_fills_aligners_trt_llm_section_from_the_stage_config():
    cfg = load_train_config(GRPOConfig, "tiny_cpu_klcf", ["trainer.backend=aligner", "model.restore_from_path=/x.nemo",
                                                          "rollout.engine=trtllm", "rollout.trtllm_model_type=qwen",
                                                          "data.max_prompt_tokens=700", "trainer.seed=99"])
    runtime = AlignerRuntime(seed=cfg.trainer.seed, rollout_micro_batch_size=48)
    section = trt_llm_section(cfg.rollout.engine, runtime, model_type=cfg.rollout.trtllm_model_type,
                              max_input_len=cfg.data.max_prompt_tokens)
    reinforce = model_overrides({"length_params": {"max_length": 300}}, runtime, section)["reinforce"]
    assert reinforce["trt_llm"] == {"enable": True, "max_input_len": 700, "model_type": "qwen", "unload_engine_train": False,
                                    "reshard": False, "seed": 99}
    # the engine's batch is the rollout micro batch, its generation length the stage's max_length
    assert reinforce["rollout_micro_batch_size"] == 48 and reinforce["length_params"]["max_length"] == 300
    default = model_overrides({}, runtime)["reinforce"]["trt_llm"]
    assert default["enable"] is False  # megatron: NeMo's own generation


def test_the_section_keys_are_the_ones_aligner_reads(venv):
    """NeMo-Aligner 0.7.0's REINFORCE actor reads ``reinforce.trt_llm.<key>``: every key we set is one of them."""
    source = next(venv.glob("lib/python*/site-packages/nemo_aligner/models/nlp/gpt/megatron_gpt_reinforce_actor.py")).read_text()
    read = set(re.findall(r'reinforce\.trt_llm\.get\("(\w+)"', source)) | set(re.findall(r"reinforce\.trt_llm\.(\w+)\b", source))
    assert set(trt_llm_section("trtllm", AlignerRuntime(), model_type="qwen")) <= read - {"get"}, read


def test_trtllm_without_tensorrt_llm_fails_at_start_up_in_one_line(tmp_path, capsys):
    from nemo_factuality.cli import main as cli

    data = write_jsonl(tmp_path / "klcf.jsonl", [{"prompt": "Tell me about Ada.", "checklist": ["Ada was born in 1917."]}])
    assert cli(["train", "grpo", "--config-name", "tiny_cpu_klcf", "trainer.backend=aligner", "rollout.engine=trtllm",
                "model.restore_from_path=/no/such.nemo", f"data.train={data}", "reward=null",
                "remote_rm.url=http://127.0.0.1:9", f"exp_manager.explicit_log_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rollout.engine=trtllm needs the tensorrt_llm package and a CUDA GPU" in err
    assert "use rollout.engine=megatron" in err


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine=trtllm"], "rollout.engine=trtllm is NeMo-Aligner's TensorRT-LLM generation: it needs trainer.backend=aligner"),
    (["rollout.engine=tensorrt"], "rollout.engine='tensorrt' (choose one of megatron, vllm, trtllm)"),
    (["rollout.engine=vllm", "trainer.backend=aligner", "model.restore_from_path=/x"], "rollout.engine=vllm needs trainer.backend=hf or megatron"),
])
def test_bad_engine_settings_name_the_key(overrides, message):
    from nemo_factuality.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        load_train_config(GRPOConfig, "tiny_cpu_klcf", ["model.path=/models/policy", *overrides])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Qwen2 (extracted) and a tiny Llama (.nemo tar), written by our converter."""
    from nemo_factuality.testing.servers import convert_checkpoint
    from nemo_factuality.testing.tiny_models import build_tiny_causal_lm, build_tiny_tokenizer

    root = tmp_path_factory.mktemp("trtllm_family")
    out = {}
    for family, packing in (("qwen2", ["--extracted"]), ("llama", [])):
        build_tiny_causal_lm(family, out_dir=root / f"hf_{family}")
        build_tiny_tokenizer(root / f"hf_{family}")
        out[family] = root / f"{family}.nemo"
        convert_checkpoint("hf-to-nemo", "--hf", str(root / f"hf_{family}"), "--out", str(out[family]), *packing)
    return out


def _without_hf_config(nemo, out):
    """The checkpoint as NeMo's save_to leaves it after training: no hf_config.json, only model_config.yaml."""
    import shutil
    import tarfile

    if nemo.is_dir():
        shutil.copytree(nemo, out)
        (out / "hf_config.json").unlink()
        return out
    with tarfile.open(nemo) as src, tarfile.open(out, "w") as dst:
        for member in src.getmembers():
            if member.name.lstrip("./") != "hf_config.json":
                dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out


def test_the_engines_model_type_is_the_checkpoints_family(converted, tmp_path):
    """Qwen2 (QKV biases) → qwen, Llama → llama, from the converter's hf_config.json or, once NeMo re-saved the
    checkpoint without it, from model_config.yaml; an explicit rollout.trtllm_model_type wins. No NeMo needed."""
    from nemo_factuality.trainers.backends.aligner.actor import trtllm_model_type

    qwen, llama = converted["qwen2"], converted["llama"]
    assert qwen.is_dir() and llama.is_file()  # an extracted checkpoint and a tar, both read in place
    assert trtllm_model_type(None, qwen) == "qwen" and trtllm_model_type(None, llama) == "llama"
    assert trtllm_model_type(None, _without_hf_config(qwen, tmp_path / "q")) == "qwen"
    assert trtllm_model_type(None, _without_hf_config(llama, tmp_path / "l.nemo")) == "llama"
    assert trtllm_model_type("llama", qwen) == "llama"  # the user's setting wins
    cfg = load_train_config(GRPOConfig, "tiny_cpu_klcf", ["trainer.backend=aligner", f"model.restore_from_path={qwen}"])
    assert cfg.rollout.trtllm_model_type is None  # the default is "the checkpoint's", no longer llama


def test_a_checkpoint_of_neither_family_is_one_line(tmp_path):
    from nemo_factuality.trainers.backends.aligner.actor import trtllm_model_type
    from nemo_factuality.types import FactualityInputError

    (tmp_path / "model_config.yaml").write_text("mcore_gpt: true\nbias: true\n")
    with pytest.raises(FactualityInputError, match="bias=true .*neither Qwen2 nor Llama"):
        trtllm_model_type(None, tmp_path)
