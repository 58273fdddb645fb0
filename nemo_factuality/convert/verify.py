"""Check a converted checkpoint by logits: Megatron-Core GPTModel (loaded from the .nemo) vs the HF model.

    python -m nemo_factuality.convert.verify --hf DIR --nemo FILE [--tol 1e-5]                  # TP=1
    torchrun --nproc_per_node=2 -m nemo_factuality.convert.verify --hf DIR --nemo FILE --tp 2    # TP=2

The Megatron model uses the local layer spec (no Transformer Engine), so it runs on CPU (gloo) as well
as GPU; the dist checkpoint is resharded at load time for the requested TP. Prints one JSON line
(rank 0) and exits non-zero when the max |Δlogit| exceeds ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def build_model(spec, tp: int):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads, ffn_hidden_size=spec.ffn, kv_channels=spec.head_dim,
        tensor_model_parallel_size=tp, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps, add_bias_linear=False, add_qkv_bias=spec.qkv_bias, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=spec.padded_vocab,
                    max_sequence_length=spec.max_positions, position_embedding_type="rope",
                    rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
                    share_embeddings_and_output_weights=spec.tied, parallel_output=True)


def load_into(model, weights_dir: str) -> None:
    """Load our TE-named, ``model.``-prefixed dist checkpoint into a local-spec model (resharding to its TP)."""
    from megatron.core import dist_checkpointing

    from nemo_factuality.convert.mapping import to_te_name

    # `_extra_state` entries are layer bookkeeping (FP8 metadata etc.), not weights: our checkpoints carry none.
    sharded = {k: v for k, v in model.sharded_state_dict(prefix="").items() if not k.endswith("_extra_state")}
    for value in sharded.values():
        if hasattr(value, "key"):
            value.key = "model." + to_te_name(value.key)
    loaded = dist_checkpointing.load(sharded, weights_dir)
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")


def mcore_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    seq = tokens.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(tokens.to(device), position_ids.to(device), mask.to(device))
    return gather_from_tensor_model_parallel_region(logits).float().cpu()


def hf_logits(hf_dir: str, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits[..., :vocab]


def run(hf_dir: str, nemo: str, tp: int, tol: float, seq: int = 16) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nemo_factuality.convert import cpu
    from nemo_factuality.convert.nemo_format import load_nemo_tensors, opened_nemo

    cpu.apply()
    if not dist.is_initialized():
        if "RANK" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
        else:
            from nemo_factuality.convert.nemo_format import ensure_process_group

            ensure_process_group()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    with opened_nemo(nemo) as root:
        _, spec, _ = load_nemo_tensors(root, check_manifest=dist.get_rank() == 0)
        model = build_model(spec, tp).eval()
        load_into(model, str(root / "model_weights"))
    if torch.cuda.is_available():  # the real Megatron CUDA path (no CPU shims are active then)
        model = model.cuda()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (2, seq), generator=gen)
    ours = mcore_logits(model, tokens)[..., : spec.vocab]
    result = {"tp": tp, "shape": list(ours.shape)}
    if dist.get_rank() == 0:
        ref = hf_logits(hf_dir, tokens, spec.vocab)
        result["max_abs_diff"] = float((ours - ref).abs().max())
        result["ok"] = result["max_abs_diff"] <= tol
    parallel_state.destroy_model_parallel()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nemo_factuality.convert.verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True)
    ap.add_argument("--nemo", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args(argv)
    result = run(args.hf, args.nemo, args.tp, args.tol)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(result), flush=True)
        return 0 if result.get("ok") else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
