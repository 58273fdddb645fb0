"""hf backend rollouts with a static KV cache and ``torch.compile`` (``model.hf_generation=compiled``): for one-GPU
users and small models, where transformers' eager ``generate`` is bound by Python on the host.

transformers compiles the decoding forward when ``generate`` runs with a static cache and a ``CompileConfig``; a graph
is traced for each input shape, so every call here has one of few shapes: the batch is always
``model.rollout_micro_batch_size`` rows (a short chunk is filled with copies of its first prompt, dropped afterwards)
and the prompt width is rounded up to a multiple of ``WIDTH_BUCKET`` tokens (more left padding, which the attention
mask hides). A new graph is logged with its shape, so recompiles are visible; their number is bounded by the prompt
widths a run sees, one per bucket. Eager stays the default: on a CPU the compile costs about a minute for a 1.65×
faster decode (measured on the tiny policy), and on a GPU it was not measured here (no GPU in the session).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

WIDTH_BUCKET = 64  # prompt widths are rounded up to a multiple of this: one compiled graph per bucket
COMPILE_BACKEND = "inductor"  # torch.compile's backend (tests on CPU trace with "eager", which skips code generation)


def padded_prompts(prompt_ids: Sequence[Sequence[int]], pad_id: int, rows: int,
                   bucket: int = WIDTH_BUCKET) -> tuple[torch.Tensor, torch.Tensor]:
    """``[max(rows, n), W]`` left-padded prompt ids and their attention mask, ``W`` the longest prompt rounded up to a
    multiple of ``bucket`` (1: eager's exact width); rows past the prompts repeat the first one (their output is
    dropped)."""
    n = len(prompt_ids)
    width = -(-max(len(p) for p in prompt_ids) // bucket) * bucket
    filled = list(prompt_ids) + [prompt_ids[0]] * max(0, rows - n)
    left = torch.full((len(filled), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(left)
    for i, p in enumerate(filled):
        left[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return left, mask


def compiled_config(config: Any, device: torch.device) -> Any:
    """``config`` (a ``GenerationConfig``) generating with a static cache and a compiled decoding forward (whole graph,
    static shapes; CUDA graphs through ``reduce-overhead`` on a GPU)."""
    from transformers import CompileConfig

    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=COMPILE_BACKEND,
                                   mode="reduce-overhead" if device.type == "cuda" else "default")
    if device.type != "cuda":
        compile_config._compile_all_devices = True  # transformers compiles only on accelerators unless told
    config.cache_implementation = "static"
    config.compile_config = compile_config
    return config


class GraphLog:
    """Logs each decoding graph ``torch.compile`` traces during a ``generate`` call, with the call's shape."""

    def __init__(self) -> None:
        self.graphs = self._count()

    @staticmethod
    def _count() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def after(self, rows: int, width: int, new_tokens: int) -> int:
        """The graphs traced since the last call (logged when any were)."""
        now = self._count()
        traced, self.graphs = now - self.graphs, now
        if traced:
            log.info("hf_generation=compiled: traced %d decoding graph(s) for %d rows × %d prompt tokens + %d new "
                     "(%d so far)", traced, rows, width, new_tokens, now)
        return traced
