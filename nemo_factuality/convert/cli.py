"""``nemo-factuality convert hf-to-nemo | nemo-to-hf | verify``.

    nemo-factuality convert hf-to-nemo --hf DIR --out model.nemo [--dtype bfloat16] [--extracted] [--tp 8 --pp 2]
    nemo-factuality convert nemo-to-hf --nemo model.nemo --out DIR [--hf-config config.json]
    nemo-factuality convert verify --hf DIR --nemo model.nemo [--tp 2] [--pp 2] [--tol 1e-5]
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from nemo_factuality.cli import ArgumentParser, UsageError, positive_int
from nemo_factuality.convert.verify import add_verify_arguments


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="nemo-factuality convert", description="HF <-> NeMo (Megatron-Core torch_dist) checkpoint "
                       "conversion, and a logits check of the result against HF")
    sub = p.add_subparsers(dest="action", required=True, metavar="{hf-to-nemo,nemo-to-hf,verify}")
    a = sub.add_parser("hf-to-nemo", help="HF Llama/Qwen2 (or *ForSequenceClassification RM) -> .nemo",
                       description="HF Llama/Qwen2 (or *ForSequenceClassification RM) -> .nemo")
    a.add_argument("--hf", required=True, help="HF model directory (config.json, safetensors, tokenizer files)")
    a.add_argument("--out", required=True, help="the .nemo tar to write (a directory with --extracted)")
    a.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype of the stored weights")
    a.add_argument("--extracted", action="store_true", help="write the extracted-directory form instead of a tar")
    a.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=None,
                   help="vocabulary padding multiple (default: NeMo's rule, the largest power of two <= 128 dividing it)")
    a.add_argument("--tp", type=positive_int, default=1, help="pre-shard for this tensor-parallel size (any TP can still load it)")
    a.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size written into model_config.yaml")
    a.add_argument("--restart", action="store_true", help="discard an unfinished conversion instead of resuming it")
    b = sub.add_parser("nemo-to-hf", help=".nemo (ours or NeMo/Aligner-trained) -> HF directory",
                       description=".nemo (ours or NeMo/Aligner-trained) -> HF directory")
    b.add_argument("--nemo", required=True, help="the .nemo archive or extracted checkpoint directory")
    b.add_argument("--out", required=True, help="the HF directory to write (replaced when complete)")
    b.add_argument("--hf-config", default=None, help="the original config.json, for checkpoints that do not pack one")
    b.add_argument("--max-shard-size-gb", type=float, default=5.0, help="largest safetensors shard, in GB")
    b.add_argument("--drop-rm-bias", action="store_true", help="convert a reward model whose rm_head.bias is not zero")
    add_verify_arguments(sub.add_parser("verify", help="compare Megatron-Core logits (from the .nemo) with the HF model",
                                        description="compare Megatron-Core logits (from the .nemo) with the HF model"))
    return p


def _require(path: str, flag: str, kind: str) -> None:
    if not Path(path).exists():
        raise UsageError(f"{flag} {path} does not exist")
    if kind == "dir" and not Path(path).is_dir():
        raise UsageError(f"{flag} {path} is not a directory (an HF model directory is expected)")


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    if args.action == "hf-to-nemo":
        from nemo_factuality.convert.nemo_format import hf_to_nemo

        _require(args.hf, "--hf", "dir")
        print(hf_to_nemo(args.hf, args.out, dtype=args.dtype, extracted=args.extracted, tp=args.tp, pp=args.pp,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, restart=args.restart))
        return 0
    if args.action == "nemo-to-hf":
        from nemo_factuality.convert.nemo_format import nemo_to_hf

        _require(args.nemo, "--nemo", "any")
        print(nemo_to_hf(args.nemo, args.out, hf_config=args.hf_config, max_shard_bytes=int(args.max_shard_size_gb * 1e9),
                         drop_rm_bias=args.drop_rm_bias))
        return 0
    _require(args.hf, "--hf", "dir")
    _require(args.nemo, "--nemo", "any")
    from nemo_factuality.convert.verify import check_inputs

    check_inputs(args.hf, args.nemo, args.tp, args.pp)  # here, once: not one line per rank, and before Megatron's import warnings
    cmd = [sys.executable, "-m", "nemo_factuality.convert.verify", "--hf", args.hf, "--nemo", args.nemo,
           "--tp", str(args.tp), "--pp", str(args.pp), "--tol", str(args.tol)]
    if args.tp * args.pp > 1:  # one process per model-parallel rank
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.tp * args.pp}", "--master_addr=127.0.0.1",
               f"--master_port={os.environ.get('NF_VERIFY_PORT', '29650')}", "-m", "nemo_factuality.convert.verify"] + cmd[3:]
    return subprocess.call(cmd)
