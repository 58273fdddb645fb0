"""Per-GPU memory arithmetic both Megatron backends' presets share (``aligner/memory.py``, ``megatron/memory.py``):
a model's parameters, its resident states and a training step's peak.

Bytes per parameter, per GPU, of the ``n`` parameters the busiest GPU holds (``Arch.stage_parameters``: about
``P / M`` of P parameters at model-parallel size M = TP·PP, plus the norms every TP rank keeps whole and, with PP > 1,
the larger of the embedding and the output layer — a critic's first stage holds the embedding and its last only a
one-output head), data-parallel size DP:

* weights, bf16 (bf16 mixed precision): ``2n``;
* gradients, fp32 accumulation buffer (Megatron's DDP with ``grad_reduce_in_fp32``; conservative where NeMo keeps
  them in bf16): ``4n``;
* Adam (fp32 main weights + 2 moments): ``12n``, divided by DP with the distributed optimizer.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
with flash attention so no ``a·s²`` score term): full recompute keeps each layer's input
(``2·s·b·h`` bytes, ÷TP with sequence parallelism, whole on each TP rank without it) for the stage's layers and
the 1F1B in-flight micro batches (≤ PP), plus one layer's working set while it is recomputed: ``34·s·b·h / TP``
with sequence parallelism, ``(10 + 24/TP)·s·b·h`` without (the norms' tensors and dropout masks are not split).
The loss needs ``s·b·V/TP`` fp32 logits about three times (logits, log-softmax, gradient). Every total adds
``overhead_gib`` (CUDA context, NCCL buffers, allocator fragmentation).

The no-grad log-prob forward (old and reference log-probs, ``model.forward_micro_batch_size`` sequences at once) keeps
no activations; its peak is the logits' ``B·s·b·V/TP`` bytes (``logprob_logits_bytes``), ``B`` the bytes per logit the
backend's log-prob path holds at once: each backend states its own (``aligner.memory``, ``megatron.memory``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1024**3
H100_GIB = 79.0  # what torch reports as an H100-80GB's memory (vLLM's gpu_memory_utilization is a share of it)
# What a preset may use of one H100-80GB: 15% stays free for allocator spikes.
H100_BUDGET_GIB = 0.85 * H100_GIB


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    qkv_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameters(self) -> int:
        h, d = self.hidden, self.head_dim
        qkv = h * (self.heads + 2 * self.kv_heads) * d + (self.heads + 2 * self.kv_heads) * d * self.qkv_bias
        layer = qkv + self.heads * d * h + 3 * h * self.ffn + 2 * h
        return self.layers * layer + self.vocab * h * (1 if self.tied else 2) + h

    def stage_parameters(self, tp: int, pp: int, *, value_head: bool = False) -> int:
        """Parameters on one GPU of the busiest pipeline stage, Megatron's split: in each layer the attention and MLP
        projections (their biases too) split over TP and the two norms whole on every TP rank; the layers evenly over
        PP; the embedding (its vocabulary split over TP) on the first stage; the final norm and the output layer (split
        likewise) on the last — a tied output layer is the embedding, copied to the last stage when PP > 1.
        ``value_head``: the critic's one-output head (weight and bias, whole) instead of the output layer."""
        h, d = self.hidden, self.head_dim
        split = (self.heads + 2 * self.kv_heads) * d * (h + self.qkv_bias) + self.heads * d * h + 3 * h * self.ffn
        if split % tp or self.vocab % tp or self.layers % pp:
            raise ValueError(f"{self} does not split over TP={tp}, PP={pp}")
        layers = self.layers // pp * (split // tp + 2 * h)
        embedding = self.vocab * h // tp
        output = h + 1 if value_head else (embedding if not self.tied or pp > 1 else 0)
        last = h + output  # the final norm and the output layer
        return layers + embedding + last if pp == 1 else layers + max(embedding, last)


@dataclass(frozen=True)
class ParallelLayout:
    """A job's parallel layout: tensor × pipeline model parallelism, the rest data parallelism (the one layout type:
    the megatron backend builds its process groups to one, the memory tables below extend it)."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class Layout(ParallelLayout):
    """A preset's layout as the memory arithmetic needs it: the parallel sizes and the batch shapes and settings."""

    micro_batch: int  # sequences per training micro batch
    seq_len: int  # prompt + response tokens in training
    rollout_micro_batch: int = 0  # sequences generated together (the aligner backend's own generation)
    forward_micro_batch: int = 0  # sequences per no-grad log-prob forward (model.forward_micro_batch_size)
    prompt_len: int = 0
    # full | selective | none. Selective recompute (Megatron's attention core) keeps what none keeps here: with flash
    # attention the core stores no s² scores, the only term selective recompute drops (Korthikanti et al.)
    recompute: str = "full"
    sequence_parallel: bool = True
    distributed_optimizer: bool = True
    offload_adam: bool = True
    overhead_gib: float = 4.0


def states_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """The model's resident bytes on its busiest GPU (``parameter_states`` of ``Arch.stage_parameters``)."""
    return parameter_states(arch.stage_parameters(lay.tp, lay.pp), lay)


def parameter_states(n: int, lay: Layout) -> dict[str, float]:
    """Resident bytes on a GPU holding ``n`` parameters of a model (its TP×PP shard, ``Arch.stage_parameters``): bf16
    weights ``2n``, fp32 gradient buffer ``4n``, Adam's fp32 main weights and moments ``12n`` (÷DP with the
    distributed optimizer)."""
    optimizer = 12 * n / (lay.dp if lay.distributed_optimizer else 1)
    return {"weights": 2.0 * n, "grads": 4.0 * n, "optimizer": optimizer}


def layer_working_set(sbh: int, lay: Layout) -> float:
    """One layer's activations for backward (Korthikanti et al., Table 2, flash attention: no ``5·a·s²·b`` term).
    With sequence parallelism every tensor is split over TP: ``34·s·b·h / TP``. Without it only the tensors inside
    the attention and MLP blocks are (``24·s·b·h / TP``); the layer norms' inputs and outputs and the dropout masks
    stay full-size on each TP rank (``10·s·b·h``)."""
    if lay.sequence_parallel:
        return 34 * sbh / lay.tp
    return sbh * (10 + 24 / lay.tp)


def training_bytes(arch: Arch, lay: Layout) -> dict[str, float]:
    """Peak bytes per GPU during a training step, by component, plus ``total``."""
    out = states_bytes(arch, lay)
    sbh = lay.seq_len * lay.micro_batch * arch.hidden
    layers = math.ceil(arch.layers / lay.pp)
    in_flight = min(lay.pp, 8)
    if lay.recompute == "full":
        kept = 2 * sbh / (lay.tp if lay.sequence_parallel else 1) * layers * in_flight
        out["activations"] = kept + layer_working_set(sbh, lay)
    else:
        out["activations"] = layer_working_set(sbh, lay) * layers * in_flight
    out["logits"] = 3 * 4 * lay.seq_len * lay.micro_batch * arch.vocab / lay.tp
    out["overhead"] = lay.overhead_gib * GIB
    out["total"] = sum(out.values())
    return out


def logprob_logits_bytes(arch: Arch, *, seq_len: int, batch: int, tp: int, bytes_per_logit: int) -> float:
    """Peak bytes per GPU of the log-prob forward's logits: ``bytes_per_logit · s · b · V / TP`` (each TP rank holds
    its ``[b, s, V/TP]`` vocabulary shard; the log-softmax's reductions over V are ``[b, s, 1]``, negligible)."""
    return bytes_per_logit * seq_len * batch * arch.vocab / tp


def gib(table: dict[str, float]) -> dict[str, float]:
    """A byte table in GiB, one decimal."""
    return {k: round(v / GIB, 1) for k, v in table.items()}
