"""Per-GPU memory arithmetic for the aligner presets (``conf/train/aligner/*.yaml``): training, rollout and log-prob
peaks
(the states, activations and training step are ``backends/memory.py``'s, shared with the megatron presets; NeMo's own
generation and the checkpoint's bytes are this backend's).

Bytes per parameter, per GPU (P parameters, model-parallel size M = TP·PP, data-parallel size DP):

* weights, bf16 (``megatron_amp_O2``): ``2·P / M``;
* gradients, fp32 accumulation buffer (conservative; NeMo may keep them in bf16): ``4·P / M``;
* Adam (fp32 master copy + 2 moments): ``12·P / M``, divided by DP with the distributed optimizer; zero
  during rollouts when ``offload_adam_states`` moves them to host memory;
* the reference policy lives on the host (``cpu_weight_swap``): no GPU bytes.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
with flash attention so no ``a·s²`` score term): full recompute keeps each layer's input
(``2·s·b·h`` bytes, ÷TP with sequence parallelism, whole on each TP rank without it) for the stage's layers and
the 1F1B in-flight micro batches (≤ PP), plus one layer's working set while it is recomputed: ``34·s·b·h / TP``
with sequence parallelism, ``(10 + 24/TP)·s·b·h`` without (the norms' tensors and dropout masks are not split).
The loss needs ``s·b·V/TP`` fp32 logits about three times (logits, log-softmax, gradient). A rollout holds the
KV cache ``2·L/PP · ⌈kv/TP⌉ · d · 2 bytes`` per token for ``rollout_micro_batch × seq`` tokens and, at the
context step, its fp32 logits ``4·b·p·V/TP`` and the final hidden state and final-norm output ``2 · 2·b·p·h``
(bf16, whole on each TP rank: NeMo generates without sequence parallelism). Every total adds ``overhead_gib``
(CUDA context, NCCL buffers, allocator fragmentation). Rollout batches are sized to ``ROLLOUT_BUDGET_SHARE`` of
the budget.

The log-prob forward (old and reference log-probs, ``get_inference_log_probs``, ``forward_micro_batch_size``
sequences at once, no grad) runs inside ``prepare_for_inference``, which offloads the Adam states exactly as around
generation (``AlignerActor._inference``): weights and the grad buffer stay, the optimizer term is 0. Its peak is the
logits, ``LOGPROB_BYTES_PER_LOGIT = 12`` bytes each (``backends.memory.logprob_logits_bytes``): Megatron-Core's
``Float16Module`` returns the last stage's output as fp32 (the bf16 ``[b, s, V/TP]`` is released), and Aligner's
``from_parallel_logits_to_logprobs(higher_stability=True)`` then holds two more fp32 tensors of that shape at once
(``logits - max`` and its ``exp()``; then the log-softmax and its clone) — three fp32 copies. Measured on CPU with
Aligner's own function (``tests/trainers/test_aligner_presets.py``): 12.0 bytes per logit. A preset's forward micro
batch is lowered to the largest that fits the budget where its wanted one does not (``budgeted_forward_micro_batch``).

One GPU measurement (README, GPU smoke kit: H100, Qwen2.5-0.5B shape, TP=1, bf16): training at micro batch 4 ×
320 tokens peaked at 12.7 GiB against 14.5 predicted, rollout batch 16 at 4.3 GiB against 7.4 — an
over-prediction at that size, mostly the fixed 4 GiB overhead.
"""

from __future__ import annotations

import math
from dataclasses import replace

from nemo_factuality.trainers.backends.memory import (  # noqa: F401  (the shared formulas, re-exported)
    GIB,
    H100_BUDGET_GIB,
    Arch,
    Layout,
    gib,
    layer_working_set,
    logprob_logits_bytes,
    states_bytes,
    training_bytes,
)

# A preset's rollout batch is sized to this share of the budget, not all of it: filling the budget left the 32B
# GRPO preset at 66.4 of 67.1 GiB, with nothing for what the formula does not see, and its rollout side was
# measured only at 0.5B (it over-predicted there; README). 10% of the budget stays free at every rollout peak.
ROLLOUT_BUDGET_SHARE = 0.9
# The log-prob forward's bytes per logit [b, s, V/TP] at its peak: Float16Module's fp32 output 4 + Aligner's stable
# distributed log-softmax's two fp32 temporaries 4 + 4 (module docstring; measured 12.0 on CPU by the tests)
LOGPROB_BYTES_PER_LOGIT = 12


def rollout_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """Peak bytes per GPU while generating (Adam states offloaded to the host when ``offload_adam``)."""
    out = states_bytes(arch, lay)
    if lay.offload_adam:  # only the Adam states move; the contiguous grad buffer stays allocated
        out["optimizer"] = 0.0
    kv_per_token = 2 * math.ceil(arch.layers / lay.pp) * math.ceil(arch.kv_heads / lay.tp) * arch.head_dim * 2
    out["kv_cache"] = kv_per_token * lay.rollout_micro_batch * lay.seq_len
    out["logits"] = 4 * lay.rollout_micro_batch * lay.prompt_len * arch.vocab / lay.tp
    # the context step's final hidden state and final-norm output, bf16, whole on each TP rank (NeMo generates
    # without sequence parallelism), alive while the output layer computes the logits above
    out["hidden"] = 2 * 2 * lay.rollout_micro_batch * lay.prompt_len * arch.hidden
    out["overhead"] = lay.overhead_gib * GIB
    out["total"] = sum(out.values())
    return out


def max_rollout_batch(arch: Arch, lay: Layout, budget_gib: float = H100_BUDGET_GIB) -> int:
    """The most sequences one rank can generate together within ``budget_gib`` (``rollout_bytes`` is affine in
    ``rollout_micro_batch``: the resident states plus, per sequence, its KV cache and first-step logits)."""
    fixed = rollout_bytes(arch, replace(lay, rollout_micro_batch=0))["total"]
    per_sequence = rollout_bytes(arch, replace(lay, rollout_micro_batch=1))["total"] - fixed
    return max(0, math.floor((budget_gib * GIB - fixed) / per_sequence))


def budgeted_rollout_batch(arch: Arch, lay: Layout, rollouts_per_rank: int, budget_gib: float = H100_BUDGET_GIB) -> int:
    """A preset's rollout batch: as many of a step's ``rollouts_per_rank`` as ``ROLLOUT_BUDGET_SHARE`` of the budget
    allows at once."""
    return min(rollouts_per_rank, max_rollout_batch(arch, lay, ROLLOUT_BUDGET_SHARE * budget_gib))


def logprob_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """Peak bytes per GPU of the no-grad log-prob forward at ``lay.forward_micro_batch`` sequences (Adam offloaded by
    ``prepare_for_inference`` when ``offload_adam``)."""
    out = states_bytes(arch, lay)
    if lay.offload_adam:
        out["optimizer"] = 0.0
    out["logits"] = logprob_logits_bytes(arch, seq_len=lay.seq_len, batch=lay.forward_micro_batch, tp=lay.tp,
                                         bytes_per_logit=LOGPROB_BYTES_PER_LOGIT)
    out["overhead"] = lay.overhead_gib * GIB
    out["total"] = sum(out.values())
    return out


def max_forward_micro_batch(arch: Arch, lay: Layout, budget_gib: float = H100_BUDGET_GIB) -> int:
    """The most sequences one log-prob forward may hold within ``budget_gib`` (``logprob_bytes`` is affine in
    ``forward_micro_batch``)."""
    fixed = logprob_bytes(arch, replace(lay, forward_micro_batch=0))["total"]
    per_sequence = logprob_bytes(arch, replace(lay, forward_micro_batch=1))["total"] - fixed
    return max(0, math.floor((budget_gib * GIB - fixed) / per_sequence))


def budgeted_forward_micro_batch(arch: Arch, lay: Layout, wanted: int, budget_gib: float = H100_BUDGET_GIB) -> int:
    """A preset's ``forward_micro_batch_size``: the ``wanted`` one, or the largest that fits the budget if smaller."""
    return min(wanted, max_forward_micro_batch(arch, lay, budget_gib))


def checkpoint_bytes(arch: Arch, method: str, *, tp: int, pp: int, dp: int) -> dict[str, float]:
    """Bytes on disk of one stage checkpoint (the whole job's, not per GPU), by component, plus ``total``.

    NeMo's distributed checkpoint writes every tensor once, whatever TP/PP/DP (data-parallel replicas are
    deduplicated; per-rank metadata and RNG files are a few KB):

    * ``weights``: the policy, bf16 (``megatron_amp_O2``): ``2·P``;
    * ``optimizer``: the distributed optimizer's fp32 main weights + 2 moments: ``12·P``;
    * ``reference``: GRPO/PPO 0 (``reference.json`` records the initial ``.nemo``); KTO ``2·P``, stored once;
    * ``critic`` (PPO, not in ``total``): the critic server's own checkpoint (``<log dir>/critic/checkpoints``), a
      model the policy's size with its Adam: ``14·P``.

    ``per_rank_references_before`` is what every global rank's ``reference.rank<r>.pt`` (its TP·PP shard of the
    bf16 weights) used to add to each checkpoint: ``DP`` full copies, ``2·P·DP``."""
    p = arch.parameters()
    out = {"weights": 2.0 * p, "optimizer": 12.0 * p, "reference": 2.0 * p if method == "kto" else 0.0}
    out["total"] = sum(out.values())
    out["critic"] = 14.0 * p if method == "ppo" else 0.0
    world = tp * pp * dp
    out["per_rank_references_before"] = 2.0 * p / (tp * pp) * world
    return out


def _sum_line(parts: dict[str, float]) -> str:
    terms = " + ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if k != "total")
    return f"{terms} = {parts['total'] / GIB:.1f}"


def _affine(fn, lay: Layout, field: str) -> tuple[float, float]:
    """(bytes at 0 sequences, bytes per sequence) of a peak affine in ``lay.<field>``."""
    fixed = fn(replace(lay, **{field: 0}))["total"]
    return fixed, fn(replace(lay, **{field: 1}))["total"] - fixed


def section_lines(arch: Arch, lay: Layout, method: str, *, rollouts_per_rank: int, wanted_forward_micro_batch: int,
                  budget_gib: float = H100_BUDGET_GIB) -> list[str]:
    """The comment lines a preset writes above each method's settings (the tests compare them verbatim): the three
    phases' peaks, how the rollout and forward micro batches were sized, and the checkpoint's bytes."""
    share = ROLLOUT_BUDGET_SHARE * budget_gib
    r_fixed, r_per = _affine(lambda la: rollout_bytes(arch, la), lay, "rollout_micro_batch")
    f_fixed, f_per = _affine(lambda la: logprob_bytes(arch, la), lay, "forward_micro_batch")
    ckpt = checkpoint_bytes(arch, method, tp=lay.tp, pp=lay.pp, dp=lay.dp)
    critic = f"; the critic server's own: {ckpt['critic'] / 1e9:.1f} GB" if method == "ppo" else ""
    return [
        f"train:   {_sum_line(training_bytes(arch, lay))}",
        f"rollout: {_sum_line(rollout_bytes(arch, lay))}",
        f"logprobs (forward micro batch {lay.forward_micro_batch}): {_sum_line(logprob_bytes(arch, lay))}",
        f"rollout batch: min({rollouts_per_rank} rollouts per rank per step, ({share:.1f} = "
        f"{ROLLOUT_BUDGET_SHARE:.0%} of the {budget_gib:.1f} budget - {r_fixed / GIB:.1f} resident) / "
        f"{r_per / GIB:.3f} per sequence = {max_rollout_batch(arch, lay, share)}) = {lay.rollout_micro_batch}",
        f"forward micro batch: min({wanted_forward_micro_batch} wanted, ({budget_gib:.1f} budget - "
        f"{f_fixed / GIB:.1f} resident) / {f_per / GIB:.2f} per sequence = {max_forward_micro_batch(arch, lay, budget_gib)}) "
        f"= {lay.forward_micro_batch}",
        f"checkpoint (the job's, on disk): weights {ckpt['weights'] / 1e9:.1f} + optimizer {ckpt['optimizer'] / 1e9:.1f} + "
        f"reference {ckpt['reference'] / 1e9:.1f} = {ckpt['total'] / 1e9:.1f} GB{critic}",
    ]
