"""Runs in the NeMo-Aligner venv (python, one gloo rank, CPU): the bytes the aligner backend's log-prob forward
allocates per logit, for ``backends.aligner.memory.LOGPROB_BYTES_PER_LOGIT``.

    python tests/trainers/aligner_logprob_memory_driver.py --b 2 --s 64 --v 4096

The path the actor runs after the model's last layer, with the installed packages' own functions: the output layer's
bf16 ``[b, s, V/TP]`` logits, Megatron-Core's ``Float16Module`` output conversion (``float16_to_fp32``: NeMo wraps
the mcore GPT model in it with ``megatron_amp_O2``, and it converts on the last pipeline stage whether training or
not), then Aligner's ``from_parallel_logits_to_logprobs(inference_only=True, higher_stability=True)`` (its
``get_logprob_output_only_func``), under ``no_grad``. The peak is read from the profiler's CPU allocation events
(every allocation and free, in order; the running sum's maximum), from before the logits exist. Prints one JSON
line: ``peak_bytes``, ``logits`` (b·s·V), their ratio and the measure's calibration (two fp32 copies alive: 8).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def peak_bytes(fn) -> int:
    """Most bytes alive at once while ``fn()`` runs (CPU allocator events, allocations positive, frees negative)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--s", type=int, default=64)
    ap.add_argument("--v", type=int, default=4096)
    args = ap.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.module import float16_to_fp32
    from nemo_aligner.utils.distributed import from_parallel_logits_to_logprobs

    mpu.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    tokens = torch.randint(0, args.v, (args.b, args.s))

    @torch.no_grad()
    def logprob_forward():
        logits = torch.randn(args.b, args.s, args.v, dtype=torch.bfloat16)  # the output layer's [b, s, V/TP]
        logits = float16_to_fp32(logits)  # Float16Module.forward's return on the last stage (the bf16 is released)
        return from_parallel_logits_to_logprobs(vocab_parallel_logits=logits, target=tokens, inference_only=True,
                                                higher_stability=True)

    def two_fp32_copies():  # the measure's own check: an fp32 tensor and its double alive at once, 8 B per element
        x = torch.randn(args.b, args.s, args.v)
        return x, x * 2

    peak = peak_bytes(logprob_forward)
    logits = args.b * args.s * args.v
    print(json.dumps({"peak_bytes": peak, "logits": logits, "bytes_per_logit": peak / logits,
                      "calibration_bytes_per_element": peak_bytes(two_fp32_copies) / logits}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
