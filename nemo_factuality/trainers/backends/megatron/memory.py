"""Per-GPU memory arithmetic and checkpoint bytes of the megatron presets (``conf/train/megatron/*.yaml``).

(``P/M`` below: the parameters the busiest GPU holds, ``Arch.stage_parameters``.) The trainer's states and training step
are ``backends/memory.py``'s (shared with the aligner presets): bf16 weights
``2P/M``, fp32 gradient buffer ``4P/M`` (``grad_reduce_in_fp32``), Adam's fp32 main weights and moments ``12P/(M·DP)``
(the distributed optimizer), recomputed activations and ``3 × fp32`` loss logits, plus a 4 GiB overhead. What differs
here:

* **No rollouts in the trainer**: a vLLM engine generates (``rollout.engine=vllm``). The trainer's second peak is the
  log-prob forward (old and reference log-probs, ``model.forward_micro_batch_size`` sequences): no activations kept,
  its logits ``14 B`` each over ``s·b·V/TP`` (``backends.memory.logprob_logits_bytes``, shared with the aligner presets
  at their measured 12): the bf16 output, the fp32 copy divided by the temperature, the fp32 temporary of ``.float()``
  and Megatron's vocab-parallel cross-entropy's buffer — the path without top-k/top-p truncation, as every stage
  config samples; truncation gathers the whole vocabulary on each TP rank. An estimate, not measured.
* **The reference** is a copy of the initial weights: on the GPU (``2P/M``) with ``model.reference=copy``, in host
  memory with ``cpu_weight_swap`` (the presets).
* **PPO's critic** is a second model of the policy's layout in the same process (Megatron-Core with a value head
  instead of the output layer: ``P − V·h + h + 1`` parameters): its states add to every phase; its own step keeps the
  policy's activations without the vocabulary logits, so it peaks below the policy's step at the same micro batch.
* **The engine** takes ``gpu_memory_utilization × 79 GiB`` of each of its GPUs for its life (vLLM reserves its share
  at start): its weights ``2P/TP_e``, ``ENGINE_OVERHEAD_GIB``, and the KV cache in the rest
  (``2·L·⌈kv/TP_e⌉·d·2 B`` per token); its process's CUDA context, ``ENGINE_CUDA_CONTEXT_GIB``, comes on top of the
  share. ``colocated``: share and context sit on the replica's GPUs beside the trainer, so a GPU holds the trainer's
  peak plus both; ``separate``: the engine's GPUs hold only the share and the context.
* **A checkpoint save** (``save_bytes``; the presets' ``model.megatron.optimizer_checkpoint=dp_reshardable``): each
  rank writes the states it holds, so the GPU holds its resident states and nothing more (no activations, nothing
  gathered); Megatron's writer copies everything a rank writes to host memory first — its optimizer shard
  ``12P/(M·DP)`` and, on its replica's first DP rank (the weights' writer), the weights ``2P/M`` (the critic's
  likewise) — beside what the host holds anyway (the reference with ``cpu_weight_swap``, ``2P/M``). The busiest node
  is counted as if all its ranks were first DP ranks (a TP=8 replica fills one). ``fully_reshardable``, the format
  for a save before a TP/PP change, gathers each shard's state on its first DP rank's host and copies it again for
  the writer (``24P/M`` more there; ``layout_change_host_bytes``). The format saved before this was counted
  (all-gathered on every GPU, ``12P/M + 12P/(M·DP)`` more per GPU) did not fit the 14B and 32B presets.

A preset fits when every GPU stays within ``H100_BUDGET_GIB`` (85% of 79 GiB) and its busiest node's host memory within
``HOST_BUDGET_GIB``. Nothing here was measured on a GPU at
the presets' sizes; the one GPU measurement of the shared formula is the aligner backend's
(``backends/aligner/memory.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from nemo_factuality.trainers.backends.memory import (
    GIB,
    H100_BUDGET_GIB,
    H100_GIB,
    Arch,
    Layout,
    logprob_logits_bytes,
    parameter_states,
    training_bytes,
)

# vLLM's memory inside its share that is not KV cache: the activations of its profiling forward
# (max_num_batched_tokens), the sampler's logits, NCCL's buffers. An estimate, not measured here (no GPU in the session
# that wrote it)
ENGINE_OVERHEAD_GIB = 2.0
# the engine process's CUDA context, outside its share: vLLM sizes the share as gpu_memory_utilization × the GPU's
# memory and takes its KV cache from what its own allocations leave of it, but the context exists before vLLM measures
# anything (about 0.5 GiB for PyTorch on an H100 with CUDA 12's lazy loading; cuBLAS and NCCL add to it). An estimate
ENGINE_CUDA_CONTEXT_GIB = 0.8
# fewest full-length sequences an engine's KV cache must hold at once for a preset to count as sized (vLLM queues the
# rest, so fewer would not fail, only generate slowly)
MIN_ENGINE_SEQUENCES = 32
LOGPROB_BYTES_PER_LOGIT = 14  # the log-prob forward's logits: bf16 2 + fp32 copy 4 + its temporary 4 + the CE buffer 4
# an 8×H100 node's host memory, the smallest of the common ones (GCP a3-highgpu-8g 1,872 GB; DGX H100 and AWS p5 2 TiB,
# Azure ND H100 v5 1.9 TiB); a preset's save may use 85% of it
HOST_GIB_PER_NODE = 1740.0
HOST_BUDGET_GIB = 0.85 * HOST_GIB_PER_NODE


@dataclass(frozen=True)
class Engine:
    """The vLLM engine of each model replica (``rollout.vllm.*``)."""

    tp: int
    gpu_memory_utilization: float
    placement: str
    seq_len: int  # the longest sequence it holds (prompt + response)


@dataclass(frozen=True)
class Plan:
    """What the arithmetic needs of one preset's method: the model, the trainer's layout and the engine."""

    arch: Arch
    layout: Layout
    engine: Engine
    reference_on_gpu: bool
    critic: bool
    nodes: int
    gpus_per_node: int
    tasks_per_node: int
    optimizer_checkpoint: str = "dp_reshardable"  # model.megatron.optimizer_checkpoint


def critic_parameters(arch: Arch) -> int:
    """The critic's parameters: the policy's backbone with a one-output value head (weight and bias) instead of the
    output layer (a tied output layer is the embedding, which the critic keeps)."""
    return arch.parameters() - (0 if arch.tied else arch.vocab * arch.hidden) + arch.hidden + 1


def method_nodes(preset: dict[str, Any], method: str) -> int:
    """The nodes ``method`` trains on: its section's ``nodes`` (PPO holds a critic too), else the preset's."""
    return int(preset[method].get("nodes", preset["nodes"]))


def plan(preset: dict[str, Any], method: str) -> Plan:
    """The arithmetic's inputs, read from the preset's own stage overrides (``common`` + the method's), so the numbers
    describe exactly what ``--preset`` trains."""
    from nemo_factuality.placement import trainer_tasks_per_node
    from nemo_factuality.trainers.presets import merge

    s = merge(preset["common"], preset[method]["overrides"])
    m, v, mc = s["model"], s["rollout"]["vllm"], s["model"]["megatron"]
    tp, pp = m["tensor_model_parallel_size"], m["pipeline_model_parallel_size"]
    tasks = trainer_tasks_per_node(v["placement"], gpus_per_node=preset["gpus_per_node"], tensor=tp, pipeline=pp,
                                   engine_tp=v["tensor_parallel_size"])
    seq = s["data"]["max_prompt_tokens"] + m["length_params"]["max_length"]
    nodes = method_nodes(preset, method)
    layout = Layout(tp=tp, pp=pp, dp=nodes * tasks // (tp * pp), micro_batch=m["micro_batch_size"],
                    seq_len=seq, recompute=mc["recompute"], sequence_parallel=mc["sequence_parallel"],
                    distributed_optimizer=mc["use_distributed_optimizer"],
                    forward_micro_batch=m["forward_micro_batch_size"])
    engine = Engine(v["tensor_parallel_size"], v["gpu_memory_utilization"], v["placement"], v.get("max_model_len") or seq)
    return Plan(arch=Arch(**preset["arch"]), layout=layout, engine=engine,
                reference_on_gpu=m.get("reference", "copy") == "copy", critic=method == "ppo", nodes=nodes,
                gpus_per_node=preset["gpus_per_node"], tasks_per_node=tasks,
                optimizer_checkpoint=mc.get("optimizer_checkpoint", "dp_reshardable"))


def _shards(p: Plan) -> list[int]:
    """Parameters on the busiest trainer GPU: the policy's, then the critic's (PPO)."""
    lay = p.layout
    return [p.arch.stage_parameters(lay.tp, lay.pp)] + (
        [p.arch.stage_parameters(lay.tp, lay.pp, value_head=True)] if p.critic else [])


def _resident(p: Plan) -> dict[str, float]:
    """The trainer's bytes per GPU in every phase: the policy's states, the critic's, the reference's."""
    shards = _shards(p)
    out = parameter_states(shards[0], p.layout)
    if p.critic:
        out["critic"] = sum(parameter_states(shards[1], p.layout).values())
    if p.reference_on_gpu:
        out["reference"] = 2.0 * shards[0]
    return out


def trainer_bytes(p: Plan) -> dict[str, dict[str, float]]:
    """Peak bytes per trainer GPU, by component (and ``total``), of a training step (``train``) and of the log-prob
    forward (``logprobs``)."""
    resident = _resident(p)
    step = training_bytes(p.arch, p.layout)
    train = {**resident, "activations": step["activations"], "logits": step["logits"], "overhead": step["overhead"]}
    logits = logprob_logits_bytes(p.arch, seq_len=p.layout.seq_len, batch=p.layout.forward_micro_batch, tp=p.layout.tp,
                                  bytes_per_logit=LOGPROB_BYTES_PER_LOGIT)
    logprobs = {**resident, "logits": logits, "overhead": step["overhead"]}
    return {phase: {**parts, "total": sum(parts.values())} for phase, parts in (("train", train), ("logprobs", logprobs))}


def engine_bytes(arch: Arch, engine: Engine) -> dict[str, float]:
    """Bytes per engine GPU: its share (``total``), split into its weights, overhead and KV cache, and ``sequences``,
    how many full-length sequences the KV cache holds at once."""
    total = engine.gpu_memory_utilization * H100_GIB * GIB
    weights = 2.0 * arch.stage_parameters(engine.tp, 1)  # vLLM splits the model as Megatron does
    overhead = ENGINE_OVERHEAD_GIB * GIB
    kv = total - weights - overhead
    per_token = 2 * arch.layers * math.ceil(arch.kv_heads / engine.tp) * arch.head_dim * 2
    return {"weights": weights, "overhead": overhead, "kv_cache": kv, "total": total,
            "sequences": max(0, math.floor(kv / (per_token * engine.seq_len)))}


def save_bytes(p: Plan) -> dict[str, dict[str, float]]:
    """A checkpoint save in the plan's format (module docstring): ``gpu``, bytes per trainer GPU by component; ``host``,
    the host bytes of a rank that is its replica's first DP rank, by component; both with ``total``, and ``host_node``
    (``{"total": …}``), the busiest node's (every rank on it counted as a first DP rank)."""
    resident = _resident(p)
    gpu = {**resident, "overhead": p.layout.overhead_gib * GIB}
    dp = p.layout.dp if p.layout.distributed_optimizer else 1
    written = _shards(p)
    host = {"staged": sum(2 * n + 12 * n / dp for n in written)}
    if p.optimizer_checkpoint == "fully_reshardable" and p.layout.distributed_optimizer:
        host["gathered"] = sum(24 * n for n in written)  # the shard's whole state, and the writer's copy of it
    if not p.reference_on_gpu:
        host["reference"] = 2 * written[0]
    gpu["total"], host["total"] = sum(gpu.values()), sum(host.values())
    return {"gpu": gpu, "host": host, "host_node": {"total": p.tasks_per_node * host["total"]}}


def layout_change_host_bytes(p: Plan) -> float:
    """The busiest node's host bytes while it saves in ``fully_reshardable`` (the save before a TP/PP change). An
    estimate from Megatron-Core 0.16.1's code, not measured."""
    return save_bytes(replace(p, optimizer_checkpoint="fully_reshardable"))["host_node"]["total"]


def trainer_peak(p: Plan) -> float:
    """A trainer GPU's largest phase, bytes: the training step, the log-prob forward or a checkpoint save."""
    phases = trainer_bytes(p)
    return max(phases["train"]["total"], phases["logprobs"]["total"], save_bytes(p)["gpu"]["total"])


def gpu_peaks(p: Plan) -> dict[str, float]:
    """The busiest GPU of each kind, bytes: ``trainer`` (a trainer GPU's largest phase — step, log-prob forward, save;
    colocated: plus the engine's share on the GPUs that hold one) and ``engine`` (a separate engine's GPU; 0 when
    colocated)."""
    trainer = trainer_peak(p)
    engine = engine_bytes(p.arch, p.engine)["total"] + ENGINE_CUDA_CONTEXT_GIB * GIB
    if p.engine.placement == "colocated":
        return {"trainer": trainer + engine, "engine": 0.0}
    return {"trainer": trainer, "engine": engine}


def largest_forward_micro_batch(p: Plan, cap: int = 16) -> int:
    """The largest log-prob forward micro batch (≤ ``cap``) whose GPU peak stays within the budget (0: none does)."""
    def peak_gib(batch: int) -> float:
        return max(gpu_peaks(replace(p, layout=replace(p.layout, forward_micro_batch=batch))).values()) / GIB

    fits = [b for b in range(1, cap + 1) if peak_gib(b) <= H100_BUDGET_GIB]
    return max(fits, default=0)


def checkpoint_bytes(arch: Arch, method: str) -> dict[str, float]:
    """Bytes on disk of one stage checkpoint (the whole job's), by component, plus ``total`` and ``final`` (the HF
    export, written once at the end, not in ``total``).

    A Megatron distributed checkpoint writes every tensor once, whatever TP/PP/DP: the bf16 weights ``2·P``; the
    distributed optimizer's fp32 main weights and Adam moments ``12·P`` (in either format); KTO's reset
    reference ``2·P`` (``reference/``; GRPO's and PPO's reference is the initial HF folder, recorded in
    ``reference.json``); PPO's critic, weights and optimizer, ``14·P_critic``. ``final/`` is an HF folder in bf16
    (``2·P``). Schedules, RNG states and metadata add kilobytes."""
    p = arch.parameters()
    out = {"weights": 2.0 * p, "optimizer": 12.0 * p, "reference": 2.0 * p if method == "kto" else 0.0,
           "critic": 14.0 * critic_parameters(arch) if method == "ppo" else 0.0}
    out["total"] = sum(out.values())
    out["final"] = 2.0 * p
    return out


def _sum_line(parts: dict[str, float]) -> str:
    terms = " + ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items() if k != "total")
    return f"{terms} = {parts['total'] / GIB:.1f}"


def section_lines(p: Plan, method: str) -> list[str]:
    """The comment lines a preset writes above each method's settings (the test compares them verbatim)."""
    phases, eng, peaks, save = trainer_bytes(p), engine_bytes(p.arch, p.engine), gpu_peaks(p), save_bytes(p)
    e, ckpt = p.engine, checkpoint_bytes(p.arch, method)
    trainer = trainer_peak(p)
    lines = [
        f"train: {_sum_line(phases['train'])}",
        f"logprobs (forward micro batch {p.layout.forward_micro_batch}): {_sum_line(phases['logprobs'])}",
        f"save ({p.optimizer_checkpoint}, on the GPU nothing gathered): {_sum_line(save['gpu'])}",
        f"  host per rank: {_sum_line(save['host'])}; per node ({p.tasks_per_node} ranks) "
        f"{save['host_node']['total'] / GIB:.1f} (budget {HOST_BUDGET_GIB:.0f}; a fully_reshardable save "
        f"{layout_change_host_bytes(p) / GIB:.0f})",
        f"engine ({e.placement}, TP={e.tp}): {e.gpu_memory_utilization} × {H100_GIB:g} = {eng['total'] / GIB:.1f} per GPU = "
        f"weights {eng['weights'] / GIB:.1f} + overhead {eng['overhead'] / GIB:.1f} + KV cache {eng['kv_cache'] / GIB:.1f}",
        f"  KV cache: {eng['sequences']} sequences of {e.seq_len} tokens at once",
        (f"per GPU: trainer {trainer / GIB:.1f} + engine {eng['total'] / GIB:.1f} + its CUDA context "
         f"{ENGINE_CUDA_CONTEXT_GIB:.1f} = {peaks['trainer'] / GIB:.1f} "
         if e.placement == "colocated" else
         f"per GPU: trainer {peaks['trainer'] / GIB:.1f}, engine {eng['total'] / GIB:.1f} + its CUDA context "
         f"{ENGINE_CUDA_CONTEXT_GIB:.1f} = {peaks['engine'] / GIB:.1f} ")
        + f"(budget {H100_BUDGET_GIB:.1f})",
        f"checkpoint (the job's, GB): weights {ckpt['weights'] / 1e9:.1f} + optimizer {ckpt['optimizer'] / 1e9:.1f} + "
        f"reference {ckpt['reference'] / 1e9:.1f} + critic {ckpt['critic'] / 1e9:.1f} = {ckpt['total'] / 1e9:.1f}; "
        f"final/ {ckpt['final'] / 1e9:.1f}",
    ]
    return lines
