"""Runs in the megatron venv (``tools/setup_stack_env.sh megatron``), under torchrun on gloo: the megatron backend's actor
against transformers on the same tiny HF checkpoint. Each command writes ``<out>/<tag>.rank<r>.json``.

    python tests/trainers/megatron_driver.py make-model --out DIR
    torchrun --nproc_per_node 2 tests/trainers/megatron_driver.py parity --hf DIR --out DIR --tag tp2 --tp 2
    torchrun --nproc_per_node 2 tests/trainers/megatron_driver.py train --hf DIR --out DIR --tag dp2

* ``make-model``: a 2-layer Qwen2 (hidden 64, head_dim 32 ≠ hidden/heads, GQA, rope_theta 123456, QKV biases; every
  bias and norm weight random, so a mis-mapped one shows) and the tiny BPE tokenizer, written by this venv's
  transformers 4.x (the layout Bridge reads).
* ``parity``: logits and log-probs against transformers after loading (at the stage's temperature 0.7 with top-k/top-p,
  and without truncation: at TP > 1 the vocab-parallel path); the gradient norm of one step of a fixed loss
  against transformers' (clipping off, SGD at lr 0: the step changes nothing); greedy rollouts against the hf backend's
  ``generate`` (transformers' ``generate``); 400 sampled first tokens against the probabilities the actor's log-probs
  give them (temperature 0.7, top-k 8, top-p 0.9); the same with ``model.megatron.inference_engine=dynamic`` on
  ``model.megatron.attention_kernels=torch`` (plain-torch paged attention: no flash-attn here), and its start-up
  refusals with ``attention_kernels=flash_attn`` where flash-attn is missing or old.
* ``parity --unfixed scatter|tp-attributes``: the same with one of the backend's fixes undone
  (``backends.megatron.build``), to show the checks above catch what it fixes.
* ``train``: a fixed batch of 8 sequences, each rank its contiguous 8/DP rows, the loss normalised by the global token
  count: step 1 (AdamW), logits; export → transformers reloads it → its logits; save; step 2 → log-probs; load → step 2
  again → log-probs (exactly equal); the reference reset to the current policy and saved with it; with ``--resume`` a
  checkpoint another layout saved is loaded first, with ``--reference-from`` one holding a reset reference last. With
  the distributed optimizer the save is watched (``LargestAllocation``: the largest tensor storage any op creates),
  and the run also saves ``<tag>_ckpt_full`` in ``optimizer_checkpoint=fully_reshardable`` (watched too); with
  ``--refused`` that checkpoint's resume at this layout must be refused (its line is recorded); the fully reshardable
  save only where ``--optimizer-checkpoint=fully_reshardable`` had Megatron's gloo groups built (elsewhere its
  refusal is recorded), and whether they were built. ``--fused-adam``:
  Megatron builds Transformer Engine's ``FusedAdam`` (the container's optimizer; ``testing/fused_adam_cpu.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nemo_factuality.testing import megatron_cpu  # noqa: E402

megatron_cpu.apply()

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from nemo_factuality.trainers.config import GRPOConfig, load_train_config  # noqa: E402
from nemo_factuality.trainers.interfaces import Rollout, SamplingParams  # noqa: E402

ROWS, WIDTH, PROMPT = 8, 11, 3
# longer than the dynamic engine's step of 64 tokens the driver sets: its prefill is chunked
LONG_PROMPT = torch.randint(5, 390, (75,), generator=torch.Generator().manual_seed(11)).tolist()


def make_model(out: Path, hidden: int = 64, tied: bool = False) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nemo_factuality.testing.tiny_models import build_tiny_tokenizer

    tok = build_tiny_tokenizer(out)
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      intermediate_size=2 * hidden, vocab_size=400, max_position_embeddings=256, rope_theta=123456.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=tied, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, torch_dtype="float32")
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: a swapped one would not show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(str(out))


def build_actor(args, *extra: str):
    from nemo_factuality.trainers.backends import BACKENDS

    overrides = [f"model.path={args.hf}", "trainer.backend=megatron", f"model.tensor_model_parallel_size={args.tp}",
                 f"model.pipeline_model_parallel_size={args.pp}", "model.forward_micro_batch_size=2",
                 "remote_rm.url=http://127.0.0.1:9", "model.global_batch_size=8", *extra]
    cfg = load_train_config(GRPOConfig, None, overrides)
    actor, _ = BACKENDS.get("megatron")(cfg)
    return actor


def fixed_batch() -> dict[str, torch.Tensor]:
    """8 sequences of 11 tokens (prompt 3), response lengths 6..11, a loss mask over each response."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(5, 390, (ROWS, WIDTH), generator=gen)
    lengths = torch.tensor([6, 11, 9, 7, 11, 10, 6, 8])
    pos = torch.arange(WIDTH - 1).unsqueeze(0)
    mask = ((pos >= PROMPT - 1) & (pos < lengths.unsqueeze(1) - 1)).float()
    return {"tokens": tokens, "prompt_lengths": torch.full((ROWS,), PROMPT), "response_lengths": lengths, "mask": mask}


def as_rollout(batch: dict[str, torch.Tensor]) -> Rollout:
    return Rollout(batch["tokens"], batch["prompt_lengths"], batch["response_lengths"], torch.ones(ROWS, dtype=torch.bool))


def policy_loss(global_tokens: float):
    def loss(out, mb):
        value = -(out["logprobs"] * mb["mask"]).sum() / global_tokens
        return value, {"loss/policy": float(value)}

    return loss


def full_logits(actor, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, S, V]`` logits of the actor's current weights (vocabulary gathered over TP, sent from the last stage)."""
    from megatron.core import tensor_parallel

    actor.model.eval()

    def logits_of(mb, logits):
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        return torch.zeros(()), {"logits": full.detach().float().cpu()}

    with torch.no_grad():
        reported = actor._run_schedule([{"tokens": tokens}], logits_of, forward_only=True)
    out = reported[0]["logits"] if reported else torch.zeros(*tokens.shape, 400)
    return actor._from_last_pipeline_stage(out)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()


def undo_fix(name: str) -> None:
    """Build without one of ``backends.megatron.build``'s fixes (the checks must then fail)."""
    from nemo_factuality.trainers.backends.megatron import build as megatron_build

    if name == "scatter":
        megatron_build.contiguous_tensor_parallel_scatter = lambda: None
    elif name == "tp-attributes":
        megatron_build.set_tensor_parallel_attributes = lambda chunks: chunks
        megatron_build.tensor_parallel_weights_unmarked = lambda chunks: []


def parity(args) -> dict:
    from nemo_factuality.trainers.backends.hf.actor import token_logprobs

    if args.unfixed:
        undo_fix(args.unfixed)
    actor = build_actor(args, "model.optim.name=sgd", "model.optim.lr=0.0", "trainer.gradient_clip_val=0",
                        "model.sampling_params.temperature=0.7", "model.sampling_params.top_k=8",
                        "model.sampling_params.top_p=0.9")
    hf = hf_model(args.reference_hf or args.hf)
    batch = fixed_batch()
    with torch.no_grad():
        ref_logits = hf(batch["tokens"]).logits
    ours = full_logits(actor, batch["tokens"])
    logprobs = actor.logprobs(as_rollout(batch))
    with torch.no_grad():
        ref_logprobs = token_logprobs(ref_logits, batch["tokens"], actor.distribution)
    valid = batch["mask"].bool()
    untruncated = _untruncated_logprobs(actor, batch, ref_logits, valid)
    # one step's gradient norm of the same loss under transformers (temperature/top-k/top-p warped log-probs)
    global_tokens = float(batch["mask"].sum())
    hf.zero_grad()
    loss = -(token_logprobs(hf(batch["tokens"]).logits, batch["tokens"], actor.distribution) * batch["mask"]).sum()
    (loss / global_tokens).backward()
    hf_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters())))
    metrics = actor.train_step(batch, policy_loss(global_tokens), micro_batch_size=2)
    return {"logits_max_diff": float((ours - ref_logits).abs().max()), "logit_scale": float(ref_logits.abs().max()),
            "logprobs_max_diff": float((logprobs - ref_logprobs)[valid].abs().max()),
            "grad_norm": metrics["grad_norm"], "hf_grad_norm": hf_norm, "loss": metrics["loss"],
            "hf_loss": float(loss) / global_tokens, **untruncated, **generations(args, actor)}


def _untruncated_logprobs(actor, batch: dict, ref_logits: torch.Tensor, valid: torch.Tensor) -> dict:
    """The presets' path: temperature 0.7 without top-k/top-p, where TP > 1 takes the log-softmax on the vocabulary
    shards (Megatron's vocab-parallel cross-entropy) instead of gathering them. Its log-probs against transformers' at
    the same temperature, and against transformers' at temperature 1 (what a dropped temperature would give)."""
    from dataclasses import replace

    from nemo_factuality.trainers.backends.hf.actor import SampledDistribution, token_logprobs

    sampled = actor.distribution
    actor.distribution = replace(sampled, top_k=0, top_p=1.0)
    try:
        ours = actor.logprobs(as_rollout(batch))
    finally:
        actor.distribution = sampled
    with torch.no_grad():
        at_t = token_logprobs(ref_logits, batch["tokens"], SampledDistribution(temperature=0.7))
        at_1 = token_logprobs(ref_logits, batch["tokens"], SampledDistribution())
    return {"untruncated_logprobs_max_diff": float((ours - at_t)[valid].abs().max()),
            "untruncated_vs_temperature_1": float((ours - at_1)[valid].abs().max())}


def generations(args, actor) -> dict:
    """Greedy rollouts of the actor and of the hf backend (transformers' generate); sampled first tokens."""
    from nemo_factuality.trainers.backends.hf.actor import HFActor

    cfg = load_train_config(GRPOConfig, None, [f"model.path={args.reference_hf or args.hf}", "remote_rm.url=http://127.0.0.1:9"])
    prompts = [[5, 17, 33, 8], [9, 60], [120, 7, 7, 41, 300, 12], [2, 44, 31], [77, 3, 250, 18, 9, 61, 140, 2, 33],
               LONG_PROMPT]
    greedy = SamplingParams(max_new_tokens=8, use_greedy=True)
    ours = actor.generate(prompts, greedy)
    ref = HFActor(cfg.model, max_steps=1).generate(prompts, greedy)
    one = [[5, 17, 33, 8, 90]]
    sampled = actor.generate(one * 400, SamplingParams(max_new_tokens=1, temperature=0.7, top_k=8, top_p=0.9))
    return {"greedy": [ours.tokens.tolist(), ours.response_lengths.tolist(), ours.is_end.tolist()],
            "hf_greedy": [ref.tokens.tolist(), ref.response_lengths.tolist(), ref.is_end.tolist()],
            "sampled": _first_token_counts(actor, sampled, len(one[0])),
            **({} if args.unfixed or args.reference_hf else _timed(dynamic_generations, actor, prompts, greedy))}


def _timed(fn, *args) -> dict:
    start = time.perf_counter()
    out = fn(*args)
    return {**out, "dynamic_seconds": time.perf_counter() - start}


def _first_token_counts(actor, sampled: Rollout, prompt_length: int) -> dict[str, list]:
    """{token: [how often it came first, the probability the actor's log-probs give it]}."""
    lp = actor.logprobs(sampled)[:, prompt_length - 1]
    first = sampled.tokens[:, prompt_length]
    return {str(t): [int((first == t).sum()), float(lp[first == t][0].exp())] for t in sorted(set(first.tolist()))}


def _as_lists(rollout: Rollout) -> list:
    return [rollout.tokens.tolist(), rollout.response_lengths.tolist(), rollout.is_end.tolist()]


def dynamic_generations(actor, prompts: list[list[int]], greedy: SamplingParams) -> dict:
    """The same actor with ``model.megatron.inference_engine=dynamic`` (``attention_kernels=torch``): pages of 4
    tokens, so each prompt and response spans several pages of the paged KV cache; steps of 64 tokens, so the 75-token
    prompt's prefill is chunked; 2 requests in flight for 6 prompts of 2–75 tokens (packed varlen prefill; the rest
    wait for a slot: continuous batching). Greedy rollouts (the test compares them with transformers'), greedy with an
    EOS the responses reach mid-way against the static engine (the dynamic engine keeps that EOS among its tokens), 400
    sampled first tokens with 64 requests in flight, a KV buffer too small for one sequence, and greedy rollouts in
    the buffer its refusal names (one whole sequence's pages, shared by the 2 requests in flight); greedy rollouts again
    at the production page size, 256 tokens (every sequence within one page)."""
    import functools

    from megatron.core.inference.contexts import dynamic_context

    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers.backends.megatron import paged_attention

    calls = {"varlen": 0, "kvcache": 0, "chunk": 0}

    def counted(name, fn):
        @functools.wraps(fn)  # keeps the kernel's mark: Megatron's version check still sees the torch kernels
        def call(*args, **kwargs):
            calls[name] += 1
            if name == "varlen":  # a later chunk of a prompt: several queries, fewer than its keys
                q_len, k_len = args[3].diff(), args[4].diff()
                calls["chunk"] += int(((q_len > 1) & (q_len < k_len)).any())
            return fn(*args, **kwargs)
        return call

    from megatron.core.transformer import attention

    m = actor.cfg
    m.megatron.attention_kernels = "torch"
    paged_attention.use_torch_kernels()  # what the actor's start-up check does with inference_engine=dynamic
    attention.flash_attn_varlen_func = counted("varlen", paged_attention.varlen)
    attention.flash_attn_with_kvcache = counted("kvcache", paged_attention.decode)
    m.megatron.inference_block_tokens, m.megatron.inference_max_step_tokens, m.megatron.inference_buffer_gb = 4, 64, 0.01
    m.megatron.inference_engine, m.rollout_micro_batch_size = "dynamic", 2
    actor.max_sequence_length = None  # each engine sized to its call: the refusal below names one call's need
    out = {"dynamic_greedy": _as_lists(actor.generate(prompts, greedy)), "greedy_chunks": calls["chunk"]}
    built, context = actor._dynamic.builds, actor._dynamic._engine.context
    # the same call again: the run's engine reused (its requests reset, every page free), not built again
    out["dynamic_greedy_again"] = _as_lists(actor.generate(prompts, greedy))
    out["dynamic_reused"] = [actor._dynamic.builds - built, actor._dynamic._engine.context is context]
    # a prompt longer than the context holds: built again for it, then reused by the calls it covers
    out["dynamic_longer"] = _as_lists(actor.generate([list(range(5, 105))], greedy))
    out["dynamic_builds_after_longer"] = actor._dynamic.builds - built
    out["dynamic_greedy_in_longer"] = _as_lists(actor.generate(prompts, greedy))
    out["dynamic_builds_after_reuse"] = actor._dynamic.builds - built
    m.megatron.inference_block_tokens = 256  # the production page size (flash-attn's paged kernels need its multiples)
    out["dynamic_greedy_256"] = _as_lists(actor.generate(prompts, greedy))
    m.megatron.inference_block_tokens = 4
    eos, actor.eos_id = actor.eos_id, 354  # reached at the second token of prompt 3 (and later by others)
    out["dynamic_eos_greedy"] = _as_lists(actor.generate(prompts, greedy))
    m.megatron.inference_engine = "static"
    out["static_eos_greedy"] = _as_lists(actor.generate(prompts, greedy))
    actor.eos_id = eos
    m.megatron.inference_engine, m.rollout_micro_batch_size = "dynamic", 64
    m.megatron.inference_max_step_tokens = None  # Megatron's 16384: 64 prompts' prefill in one step
    one = [[5, 17, 33, 8, 90]]
    sampled = actor.generate(one * 400, SamplingParams(max_new_tokens=1, temperature=0.7, top_k=8, top_p=0.9))
    out["dynamic_sampled"] = _first_token_counts(actor, sampled, len(one[0]))
    m.megatron.inference_max_step_tokens = 64
    m.megatron.inference_buffer_gb = 1e-6  # Megatron's least: 2 pages, one of them its dummy page
    try:
        actor.generate(prompts, greedy)
        out["small_buffer"] = None
    except ConfigError as err:
        out["small_buffer"] = str(err)
        m.megatron.inference_buffer_gb = float(str(err).rsplit(" ", 1)[-1])  # the size it names is enough
        out["named_buffer_greedy"] = _as_lists(actor.generate(prompts, greedy))
    out["flash_attn_calls"] = calls
    out["triton_kv_append"] = dynamic_context.triton_append_key_value_cache is not None
    m.megatron.inference_engine = "static"
    out["refusals"] = _refusals(attention)
    return out


def _refusals(attention) -> dict:
    """``check_inference_engine("dynamic", kernels)`` (the actor's start-up check): accepted with the torch kernels; with
    ``flash_attn`` where none is importable (this venv) and where its version is below Megatron's minimum (a module
    named flash_attn at 2.6.3, Megatron's attention bound to kernels that are not ours), each a one-line
    ``ConfigError``."""
    import types

    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers.backends.megatron.generate import check_inference_engine

    def refusal(kernels: str) -> str | None:
        try:
            check_inference_engine("dynamic", kernels)
        except ConfigError as err:
            return str(err)
        return None

    out = {"torch": refusal("torch"), "missing": refusal("flash_attn")}
    old = types.ModuleType("flash_attn")
    old.__version__ = "2.6.3"
    bound = attention.flash_attn_varlen_func, attention.flash_attn_with_kvcache
    sys.modules["flash_attn"] = old
    attention.flash_attn_varlen_func = attention.flash_attn_with_kvcache = lambda *a, **k: None
    try:
        out["too_old"] = refusal("flash_attn")
    finally:
        del sys.modules["flash_attn"]
        attention.flash_attn_varlen_func, attention.flash_attn_with_kvcache = bound
    return out


class LargestAllocation(TorchDispatchMode):
    """While active, the largest tensor storage (bytes) any aten op creates — an output whose storage none of the op's
    inputs holds (factories, copies, concatenations, a collective's receive buffers) — and that op."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage().data_ptr() not in held:
                if t.untyped_storage().nbytes() > self.largest:
                    self.largest, self.op = t.untyped_storage().nbytes(), str(func)
        return out


def save_as(actor, path: Path, optimizer_checkpoint: str) -> None:
    """``actor.save(path)`` with the distributed optimizer's state in ``optimizer_checkpoint`` (the run's own setting
    kept)."""
    from dataclasses import replace

    default = actor.settings
    actor.settings = replace(default, optimizer_checkpoint=optimizer_checkpoint)
    try:
        actor.save(path)
    finally:
        actor.settings = default


def _watched_saves(actor, out: Path, tag: str) -> dict:
    """Save ``<tag>_ckpt`` in dp_reshardable and, where the run built Megatron's gloo groups, ``<tag>_ckpt_full`` in
    fully_reshardable (without them that save's refusal is recorded), each watched, and — watched only — the format this
    backend wrote before (``before``: fully_reshardable all-gathered on every rank, Megatron's default variant); the
    largest parameter's bytes are the bound a save that gathers nothing stays within, the shard's the least a gather of
    its whole state creates."""
    from nemo_factuality.config import ConfigError
    from nemo_factuality.trainers.backends.megatron import model as megatron_model

    megatron_model.OPTIMIZER_FORMATS["before"] = {"distrib_optim_sharding_type": "fully_reshardable"}
    watched, result = {}, {}
    for fmt, where in (("dp_reshardable", f"{tag}_ckpt"), ("fully_reshardable", f"{tag}_ckpt_full"),
                       ("before", f"{tag}_ckpt_before")):
        if fmt == "fully_reshardable" and not actor.settings.gloo_process_groups:
            try:
                save_as(actor, out / where, fmt)
            except ConfigError as refusal:
                result["full_save_refusal"] = str(refusal)
            continue
        with LargestAllocation() as seen:
            save_as(actor, out / where, fmt)
        watched[fmt] = [seen.largest, seen.op]
    return {**result, "save_largest_bytes": watched,
            "largest_parameter_bytes": max(p.numel() * p.element_size() for p in actor.model.parameters()),
            "shard_parameter_bytes": sum(p.numel() * p.element_size() for p in actor.model.parameters())}


def gloo_groups(actor) -> dict:
    """Whether Megatron's gloo data-parallel groups exist in this process, and whether the optimizer was given one."""
    from nemo_factuality.trainers.backends.megatron import build

    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    return {"built": build.gloo_process_groups_built(),
            "optimizer": [getattr(o, "data_parallel_group_gloo", None) is not None for o in optimizers]}


def train(args) -> dict:
    actor = build_actor(args, "model.optim.name=adamw", "model.optim.lr=0.01", "trainer.gradient_clip_val=1.0",
                        f"model.megatron.use_distributed_optimizer={args.distributed_optimizer}",
                        f"model.megatron.optimizer_checkpoint={args.optimizer_checkpoint}")
    out = Path(args.out)
    result: dict = {"dp": actor.data_parallel_size, "initial_logprobs": actor.logprobs(as_rollout(fixed_batch())).tolist(),
                    "gloo_groups": gloo_groups(actor)}
    if args.refused:
        from nemo_factuality.types import FactualityInputError

        try:
            actor.load(Path(args.refused))
        except FactualityInputError as refusal:
            result["refusal"] = str(refusal)
    if args.resume:
        actor.load(Path(args.resume))
        result["resumed_logprobs"] = actor.logprobs(as_rollout(fixed_batch())).tolist()
    batch = fixed_batch()
    global_tokens = float(batch["mask"].sum())
    dp, rank = actor.data_parallel_size, actor.data_parallel_rank
    mine = {k: v[rank * ROWS // dp : (rank + 1) * ROWS // dp] for k, v in batch.items()}
    step = lambda: actor.train_step(mine, policy_loss(global_tokens), micro_batch_size=2)  # noqa: E731
    result["metrics1"] = step()
    result["logprobs1"] = actor.logprobs(as_rollout(batch)).tolist()
    trained = full_logits(actor, batch["tokens"])
    actor.export(out / f"{args.tag}_export")
    if actor.global_rank == 0:
        with torch.no_grad():
            reloaded = hf_model(str(out / f"{args.tag}_export"))(batch["tokens"]).logits
        result["export_logits_max_diff"] = float((reloaded - trained).abs().max())
        result["export_files"] = sorted(p.name for p in (out / f"{args.tag}_export").iterdir())
    ckpt = out / f"{args.tag}_ckpt"
    if args.distributed_optimizer:
        result.update(_watched_saves(actor, out, args.tag))
    else:
        actor.save(ckpt)
    result["metrics2"] = step()
    result["logprobs2"] = actor.logprobs(as_rollout(batch)).tolist()
    actor.load(ckpt)
    result["loaded_logprobs1"] = actor.logprobs(as_rollout(batch)).tolist()
    result["metrics2_after_load"] = step()
    result["logprobs2_after_load"] = actor.logprobs(as_rollout(batch)).tolist()
    result["reference_logprobs"] = actor.reference_logprobs(as_rollout(batch)).tolist()
    # KTO's reference: the current policy, then stored in the checkpoint (a distributed checkpoint of its own)
    actor.reset_reference()
    result["reset_reference_logprobs"] = actor.reference_logprobs(as_rollout(batch)).tolist()
    # read at another TP (--reference-from): with the distributed optimizer, in the layout-change format where the run
    # can write it (its gloo groups built)
    dp_only = args.distributed_optimizer and not actor.settings.gloo_process_groups
    save_as(actor, out / f"{args.tag}_refckpt", "dp_reshardable" if dp_only else "fully_reshardable")
    if args.reference_from:
        actor.load(Path(args.reference_from))
        result["loaded_reference_logprobs"] = actor.reference_logprobs(as_rollout(batch)).tolist()
    adams = [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]
    result["adam"] = {"class": [type(a).__name__ for a in adams],
                      "group_steps": sorted({g.get("step") for a in adams for g in a.param_groups if g["params"]},
                                            key=str)}
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("command", choices=["make-model", "parity", "train"])
    ap.add_argument("--hf")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tag", default="run")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--resume", help="train: load this checkpoint (saved at another layout) first")
    ap.add_argument("--distributed-optimizer", action="store_true", help="train: Megatron's distributed optimizer")
    ap.add_argument("--optimizer-checkpoint", default="dp_reshardable",
                    help="train: model.megatron.optimizer_checkpoint (fully_reshardable: Megatron's gloo groups built)")
    ap.add_argument("--fused-adam", action="store_true",
                    help="train: Megatron builds Transformer Engine's FusedAdam (the container's; testing/fused_adam_cpu.py)")
    ap.add_argument("--refused", help="train: a checkpoint whose resume at this layout must be refused (tried first)")
    ap.add_argument("--reference-from", help="train: at the end, load this checkpoint (a reset reference, another layout)")
    ap.add_argument("--reference-hf", help="parity: the folder transformers loads as the reference (default --hf)")
    ap.add_argument("--unfixed", choices=["scatter", "tp-attributes"], help="parity: without this fix of the backend")
    args = ap.parse_args()
    if args.command == "make-model":
        make_model(Path(args.out))
        return 0
    if args.fused_adam:
        from nemo_factuality.testing import fused_adam_cpu

        fused_adam_cpu.install()
    result = parity(args) if args.command == "parity" else train(args)
    rank = torch.distributed.get_rank()
    (Path(args.out) / f"{args.tag}.rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
