"""Check a converted checkpoint by logits: Megatron-Core GPTModel (loaded from the .nemo) vs the HF model
(for a reward model: the reward NeMo-Aligner computes, final hidden state through ``rm_head``, vs HF's score).

    python -m nemo_factuality.convert.verify --hf DIR --nemo FILE [--tol 1e-5]                  # TP=1
    torchrun --nproc_per_node=2 -m nemo_factuality.convert.verify --hf DIR --nemo FILE --tp 2    # TP=2
    torchrun --nproc_per_node=2 -m nemo_factuality.convert.verify --hf DIR --nemo FILE --pp 2    # PP=2

The Megatron model uses the local layer spec (no Transformer Engine), so it runs on CPU (gloo) as well
as GPU; the dist checkpoint is resharded at load time for the requested TP. Prints one JSON line
(from the last pipeline stage) and exits non-zero when the max |Δlogit| exceeds ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from nemo_factuality import exit_codes
from nemo_factuality.cli import positive_int


def build_model(spec, tp: int, pp: int = 1, pre_process: bool = True, post_process: bool = True):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        num_query_groups=spec.kv_heads, ffn_hidden_size=spec.ffn, kv_channels=spec.head_dim,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, use_cpu_initialization=True, pipeline_dtype=torch.float32,
        params_dtype=torch.float32, gated_linear_unit=True, activation_func=F.silu, normalization="RMSNorm",
        layernorm_epsilon=spec.rms_eps, add_bias_linear=False, add_qkv_bias=spec.qkv_bias, hidden_dropout=0.0,
        attention_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )
    rope = spec.rope
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=spec.padded_vocab,
                    max_sequence_length=spec.max_positions, position_embedding_type="rope",
                    pre_process=pre_process, post_process=post_process,
                    rope_scaling=rope.kind == "llama3", rope_scaling_factor=rope.factor or 8.0,
                    seq_len_interpolation_factor=rope.factor if rope.kind == "linear" else None,
                    rotary_base=int(rope.theta) if float(rope.theta).is_integer() else rope.theta,
                    share_embeddings_and_output_weights=spec.tied, parallel_output=True)


def load_into(model, weights_dir: str) -> None:
    """Load our TE-named, ``model.``-prefixed dist checkpoint into a local-spec model (resharding to its TP)."""
    from megatron.core import dist_checkpointing

    from nemo_factuality.convert.mapping import to_te_name
    from nemo_factuality.convert.torch_dist import untrusted_checkpoint_loading

    # everything the model asks for, `_extra_state` objects included, at Megatron's default strictness (as NeMo)
    sharded = model.sharded_state_dict(prefix="model.")
    assert all(v.key == "model." + to_te_name(v.key[len("model."):]) for v in sharded.values()), \
        "the local layer spec should already map its norms to Transformer Engine names"
    with untrusted_checkpoint_loading(weights_dir):
        loaded = dist_checkpointing.load(sharded, weights_dir)
    loaded = {k[len("model."):]: v for k, v in loaded.items()}
    missing, unexpected = model.load_state_dict(loaded, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:5]}, unexpected {list(unexpected)[:5]}")


def mcore_logits(model, tokens: torch.Tensor, pp: int = 1, hidden_only: bool = False) -> torch.Tensor | None:
    """Full-vocabulary logits ``[B, S, V]`` on the last pipeline stage; None on other stages.

    ``hidden_only``: the final-norm hidden states ``[S, B, H]`` instead (what NeMo-Aligner's reward model
    feeds its ``rm_head``: it switches ``post_process`` off for the forward, as done here).
    """
    from unittest.mock import patch

    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    if hidden_only:
        with patch.object(model, "post_process", False):
            out = _forward(model, tokens, pp)
        return None if out is None else out.float().cpu()
    out = _forward(model, tokens, pp)
    return None if out is None else gather_from_tensor_model_parallel_region(out).float().cpu()


def _forward(model, tokens: torch.Tensor, pp: int) -> torch.Tensor | None:
    """The last stage's output of one forward pass (through Megatron's pipeline schedule when PP > 1)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    seq = tokens.shape[1]
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand_as(tokens)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
    if pp == 1:
        with torch.no_grad():
            return model(tokens, position_ids, mask)
    captured: dict[str, torch.Tensor] = {}

    def forward_step(data_iterator, stage_model):
        batch = next(data_iterator)
        output = stage_model(*batch)

        def keep_logits(out):
            captured["logits"] = out.detach()
            return out.sum() * 0.0, {}

        return output, keep_logits

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([(tokens, position_ids, mask)]),
                                    model=[model], num_microbatches=1, seq_length=seq, micro_batch_size=tokens.shape[0],
                                    forward_only=True)
    return captured.get("logits")


def hf_logits(hf_dir: str, tokens: torch.Tensor, vocab: int, reward: bool = False) -> torch.Tensor:
    """HF logits ``[B, S, V]``, or for a sequence-classification RM its scores ``[B, 1]``."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    from nemo_factuality.local_models import dtype_keyword

    model = cls.from_pretrained(hf_dir, **{dtype_keyword(): torch.float32}).eval()
    with torch.no_grad():
        logits = model(tokens).logits
    return logits if reward else logits[..., :vocab]


def reward_from_hidden(hidden: torch.Tensor, head_weight: torch.Tensor, head_bias: torch.Tensor | None) -> torch.Tensor:
    """Aligner's binary-ranking reward: the last position's hidden state ``[S, B, H]`` through ``rm_head`` → ``[B, 1]``."""
    reward = hidden[-1].float() @ head_weight.float().T
    return reward if head_bias is None else reward + head_bias.float()


def check_inputs(hf_dir: str, nemo: str, tp: int = 1, pp: int = 1) -> None:
    """Both inputs readable, without Megatron (whose import warns about Transformer Engine and Apex): the HF
    reference (config, every safetensors header) and the checkpoint (an extracted one's configs; a file must be a
    tar), and a layout Megatron can split the model into (SmolLM2's 9 heads / 3 KV heads: not TP=2). ``convert
    verify`` runs this once before it starts a process per rank, so an error is one line."""
    import tarfile
    from pathlib import Path

    from nemo_factuality.convert.layout import check_parallelism
    from nemo_factuality.convert.mapping import spec_from_hf_config
    from nemo_factuality.convert.nemo_format import HFCheckpoint, read_nemo_config
    from nemo_factuality.types import FactualityInputError

    check_parallelism(spec_from_hf_config(HFCheckpoint(hf_dir).config, tp=tp), tp, pp)
    if Path(nemo).is_dir():
        read_nemo_config(Path(nemo))
    elif not tarfile.is_tarfile(nemo):
        raise FactualityInputError(f"--nemo {nemo} is neither a .nemo tar archive nor an extracted checkpoint directory")


def _start_megatron(tp: int, pp: int) -> Any:
    """Megatron's process groups at ``tp`` × ``pp`` (gloo on CPU); returns ``parallel_state``. Its import warnings
    about Transformer Engine and Apex are expected here (the local layer spec needs neither) and not shown."""
    import torch.distributed as dist

    from nemo_factuality.stack_warnings import expected_warnings_ignored

    with expected_warnings_ignored():
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from nemo_factuality.convert import cpu
    cpu.apply()
    if not dist.is_initialized():
        if "RANK" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
        else:
            from nemo_factuality.convert.nemo_format import ensure_process_group

            ensure_process_group()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(1234)
    return parallel_state


def run(hf_dir: str, nemo: str, tp: int, tol: float, seq: int = 16, pp: int = 1) -> dict:
    import torch.distributed as dist

    from nemo_factuality.convert.mapping import spec_from_hf_config
    from nemo_factuality.convert.nemo_format import check_manifest, opened_nemo, read_nemo_config

    check_inputs(hf_dir, nemo, tp, pp)  # the reference and the checkpoint must be readable before Megatron starts
    parallel_state = _start_megatron(tp, pp)
    with opened_nemo(nemo) as root:
        nemo_cfg, hf_config = read_nemo_config(root)
        if dist.get_rank() == 0:
            check_manifest(root)
        # pad the vocabulary as NeMo does at this TP (divisor × TP); the checkpoint's own padding may differ
        spec = spec_from_hf_config(hf_config, nemo_cfg.get("make_vocab_size_divisible_by"), tp=tp)
        model = build_model(spec, tp, pp, parallel_state.is_pipeline_first_stage(),
                            parallel_state.is_pipeline_last_stage()).eval()
        load_into(model, str(root / "model_weights"))
        head = None
        if spec.reward_head:  # the reward head is not part of GPTModel: read it from the checkpoint itself
            from nemo_factuality.convert.torch_dist import TorchDistReader

            weights = TorchDistReader(root / "model_weights")
            bias = weights.read("model.rm_head.bias") if "model.rm_head.bias" in weights.tensors else None
            head = (weights.read("model.rm_head.weight"), bias)
    if torch.cuda.is_available():  # the real Megatron CUDA path (no CPU shims are active then)
        model = model.cuda()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (2, seq), generator=gen)
    pad = hf_config.get("pad_token_id")
    if pad is not None:  # an HF classifier scores the last non-pad token: keep the pad id out
        tokens[tokens == pad] = (pad + 1) % spec.vocab
    ours = mcore_logits(model, tokens, pp, hidden_only=head is not None)
    result: dict = {"tp": tp, "pp": pp, "compared": "reward" if head is not None else "logits"}
    reporter = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    if reporter and ours is not None:
        ours = reward_from_hidden(ours, *head) if head is not None else ours[..., : spec.vocab]
        result["shape"] = list(ours.shape)
        ref = hf_logits(hf_dir, tokens, spec.vocab, reward=head is not None)
        result["max_abs_diff"] = float((ours - ref).abs().max())
        result["ok"] = result["max_abs_diff"] <= tol
    parallel_state.destroy_model_parallel()
    return result


def add_verify_arguments(v: argparse.ArgumentParser) -> None:
    """Options of ``convert verify`` (shared with ``python -m nemo_factuality.convert.verify``, one per rank)."""
    v.add_argument("--hf", required=True, help="the HF model directory the checkpoint came from (the reference)")
    v.add_argument("--nemo", required=True, help="the .nemo archive or extracted checkpoint directory")
    v.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size to load it at (one process per rank)")
    v.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size to load it at")
    v.add_argument("--tol", type=float, default=1e-5, help="largest allowed max |logit (or reward) difference|; exit 1 above")


def main(argv: list[str] | None = None) -> int:
    from nemo_factuality.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m nemo_factuality.convert.verify",
                        description="compare Megatron-Core logits (from the .nemo) with the HF model, one process per rank")
    add_verify_arguments(ap)
    args = ap.parse_args(argv)
    from nemo_factuality.stack_warnings import expected_warnings_ignored

    with expected_warnings_ignored():  # Megatron-Core's and torch.distributed's about this CPU path: its one line alone
        result = run(args.hf, args.nemo, args.tp, args.tol, pp=args.pp)
    if "max_abs_diff" in result:  # the reporting rank (last pipeline stage, TP rank 0)
        print(json.dumps(result), flush=True)
        return exit_codes.OK if result["ok"] else exit_codes.FAILURE  # the logits differ past --tol
    return 0


if __name__ == "__main__":  # through the CLI's error boundary: a bad checkpoint is one line and exit 2 per rank
    from nemo_factuality.cli import run_command
    from nemo_factuality.convert.verify import main as _main

    sys.exit(run_command(_main, sys.argv[1:], "convert verify"))
