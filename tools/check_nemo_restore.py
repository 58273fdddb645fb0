"""Restore a converted checkpoint with NeMo-Aligner's own loaders and compare it with the HF model.

    python tools/check_nemo_restore.py --nemo ckpt_dir_or.nemo --hf HF_DIR [--tokenizer-dir DIR] [--tol 1e-5]

Runs where NeMo (nemo-toolkit 2.2.x, the last with ``collections.nlp``) and NeMo-Aligner 0.7.0 are
installed, e.g. the ``nvcr.io/nvidia/nemo:24.07`` container. It follows Aligner's training scripts:
``load_and_override_model_config`` then ``load_from_nemo`` (``MegatronGPTModel`` for policies,
``MegatronGPTRewardModel`` when the checkpoint has ``rm_head``), default load strictness, then one
forward pass against HF (logits, or the scalar reward). Prints one JSON line; exit 1 above ``--tol``.

Without a GPU stack (no Transformer Engine, no Apex, CPU torch) a few shims let NeMo build the model
with the Megatron-Core local layer spec; they touch model construction only, never the checkpoint
path (config merge, key names, dist-checkpoint load, tokenizer resolution). Not part of CI: that stack
does not install there (4 min, 7.4 GB, replaces torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _cpu_shims() -> None:
    """Let NeMo 2.2 build a GPT model without TE/Apex/CUDA (only used when those are missing)."""
    from nemo_factuality.testing import aligner_cpu

    aligner_cpu.apply()


def _overrides(cpu_only: bool, tokenizer_dir: str | None):
    from omegaconf import OmegaConf

    # one device: load any pre-sharded layout at TP=PP=1 (Megatron reshards), as Aligner YAML overrides would
    cfg: dict = {"micro_batch_size": 1, "global_batch_size": 1, "optim": {"name": "adamw", "lr": 1e-5}, "seed": 1234,
                 "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1}
    if cpu_only:
        cfg.update({"transformer_engine": False, "use_cpu_initialization": True, "precision": 32, "sequence_parallel": False,
                    "apply_rope_fusion": False, "bias_activation_fusion": False, "masked_softmax_fusion": False,
                    "gradient_accumulation_fusion": False, "persist_layer_norm": False, "bias_dropout_add_fusion": False,
                    "cross_entropy_loss_fusion": False})
    if tokenizer_dir:  # a .nemo tar on NeMo 2.x: the packed tokenizer directory is not resolvable, name one
        cfg["tokenizer"] = {"type": tokenizer_dir}
    return OmegaConf.create(cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nemo", required=True)
    ap.add_argument("--hf", required=True)
    ap.add_argument("--tokenizer-dir", default=None)
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    try:
        import transformer_engine  # noqa: F401
        cpu_only = not torch.cuda.is_available()
    except ImportError:
        cpu_only = True
    if cpu_only:
        _cpu_shims()
    from lightning.pytorch import Trainer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from nemo.collections.nlp.models.language_modeling.megatron_gpt_model import MegatronGPTModel
    from nemo.collections.nlp.parts.nlp_overrides import NLPDDPStrategy
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.utils import load_and_override_model_config, load_from_nemo

    hf_config = json.loads((Path(args.hf) / "config.json").read_text())
    reward = any(a.endswith("ForSequenceClassification") for a in hf_config.get("architectures", []))
    cfg = load_and_override_model_config(args.nemo, _overrides(cpu_only, args.tokenizer_dir))
    trainer = Trainer(accelerator="cpu" if cpu_only else "gpu", devices=1, precision=32, logger=False,
                      enable_checkpointing=False, strategy=NLPDDPStrategy(process_group_backend="gloo" if cpu_only else "nccl"))
    cls = MegatronGPTRewardModel if reward else MegatronGPTModel
    model = load_from_nemo(cls, cfg, trainer, strict=True, restore_path=args.nemo).eval()
    model_parallel_cuda_manual_seed(1234)  # NeMo seeds the RNG tracker only on GPU
    device = next(model.parameters()).device
    vocab = hf_config["vocab_size"]
    tokens = torch.randint(1, vocab, (2, 16), generator=torch.Generator().manual_seed(0))  # 1..: no pad id 0
    position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)
    mask = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    ref = (AutoModelForSequenceClassification if reward else AutoModelForCausalLM).from_pretrained(args.hf, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        inputs = [t.to(device) for t in (tokens, position_ids, mask)]
        if reward:
            ours = model.model(inputs[0], torch.full((2,), 16, device=device), *inputs[1:]).float().cpu().flatten()
            theirs = ref(tokens).logits.flatten()
        else:
            ours = model.model(*inputs).float().cpu()[..., :vocab]
            theirs = ref(tokens).logits
    result = {"class": cls.__name__, "tokenizer": type(model.tokenizer).__name__, "shape": list(ours.shape),
              "max_abs_diff": float((ours - theirs).abs().max()), "cpu_shims": cpu_only}
    print(json.dumps(result), flush=True)
    return 0 if result["max_abs_diff"] <= args.tol else 1


if __name__ == "__main__":
    sys.exit(main())
