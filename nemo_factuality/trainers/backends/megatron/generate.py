"""Rollouts on the megatron backend: Megatron-Core's static inference engine (KV cache, one static batch per rollout
micro batch) over the policy's own weights, sampling from exactly the distribution the actor's log-probs are of.

* Sampling: Megatron's controller applies temperature, then top-k *or* top-p with its own top-p rule, from its own
  generator seeded once for every rank. ``StageSamplingController`` replaces that one step with the stage's
  ``SampledDistribution`` (transformers' warpers: temperature, top-k, top-p, as the hf backend and every log-prob
  here use), drawn from torch's default generator (seeded per data-parallel replica; the stages checkpoint it), and
  every rank of a model replica takes its model-parallel source rank's tokens, so the replica never diverges.
* The engine's ``generate`` reseeds torch's global generator (``torch.random.manual_seed(1234)``) on every call,
  which would make every rollout step draw the same samples: requests go through its scheduler and ``run_engine``
  instead, which do not.
* Layout: prompts right-padded with EOS (Megatron's static batch continues each prompt in place); the generated tokens
  exclude the EOS, so a response that ended is the tokens plus EOS (``is_end``), as the hf backend returns it.

``model.megatron.inference_engine=dynamic`` generates with Megatron-Core's ``DynamicInferenceEngine`` instead
(``DynamicGenerator``, built once per run and reused: its context and, on a GPU, CUDA graphs of its decode steps
switched on only while it generates): a paged KV cache (``model.megatron.inference_buffer_gb``, blocks handed to requests as
they grow), prefill of prompts of different lengths packed into one varlen forward (chunked when longer than the
engine's token budget) and continuous batching (``model.rollout_micro_batch_size`` requests in flight, the rest wait
for a finished one's slot). Its attention is flash-attn 2's paged kernels only, so it needs flash-attn >= 2.7.3
(``check_inference_engine``, at start-up). Its controller samples in ``_dynamic_step_sample_logits`` (per bucket of
requests with equal temperature/top-k/top-p, from its own generator): ``StageSamplingController`` replaces that step
with the same stage distribution and source-rank broadcast as the static path's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from nemo_factuality.config import ConfigError
from nemo_factuality.trainers.backends.hf.actor import SampledDistribution
from nemo_factuality.trainers.interfaces import Rollout, RolloutChunk, SamplingParams

# Megatron-Core 0.16.1's attention asserts this flash-attn version for dynamic batching (core/transformer/attention.py)
FLASH_ATTN_MIN_VERSION = "2.7.3"

log = logging.getLogger(__name__)


class _TokenizerAdapter:
    """The HF tokenizer as Megatron's inference controller calls it (ids in, text out; EOS is ``eod``)."""

    def __init__(self, tokenizer: Any, eos_id: int) -> None:
        self.tokenizer, self.eod, self.bos = tokenizer, eos_id, None

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def offsets(self, ids: list[int], text: str) -> list[int]:
        return [0] * len(ids)


@functools.lru_cache(maxsize=1)
def _controller_class() -> type:
    from megatron.core import parallel_state
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class StageSamplingController(TextGenerationController):
        """Megatron's controller (static and dynamic batching), sampling with the stage's distribution (module
        docstring)."""

        distribution: SampledDistribution = SampledDistribution()
        greedy: bool = False

        def sample_from_logits(self, last_token_logits: torch.Tensor, sampling_params: Any = None,
                               vocab_size: int | None = None, **kwargs: Any) -> torch.Tensor:
            """Static batching: ``[b, V]`` logits of each row's last token → ``[b]`` tokens."""
            logits = last_token_logits.float()  # [b, V]: the wrapper gathered the vocabulary over TP
            tokens = logits.argmax(dim=-1) if self.greedy else self.distribution.sample(logits)
            group = parallel_state.get_model_parallel_group()
            if torch.distributed.get_world_size(group) > 1:  # one replica, one set of tokens
                torch.distributed.broadcast(tokens, src=torch.distributed.get_process_group_ranks(group)[0], group=group)
            return tokens

        def _dynamic_step_sample_logits(self, logits: torch.Tensor) -> None:
            """Dynamic batching: ``logits`` of this step's forward (``[1, n, V]`` with only each active request's last
            token materialised, else ``[1, tokens, V]``) → the ``n`` active requests' tokens into
            ``_sampled_tokens_cuda[:n]``, where Megatron's bookkeeping reads them."""
            context = self.inference_wrapped_model.inference_context
            if context.materialize_only_last_token_logits:
                last = logits.squeeze(0)
            else:
                last = context.last_token_logits(logits)
            active = context.total_request_count - context.paused_request_count
            self._sampled_tokens_cuda[:active] = self.sample_from_logits(last[:active])

    return StageSamplingController


@contextlib.contextmanager
def sequence_parallel_off(model: Any) -> Iterator[None]:
    """``model`` (the bare ``GPTModel``) without sequence parallelism for the duration, then with it again.

    Megatron-Core 0.16.1's static inference engine refuses sequence parallelism on a dense model
    (``NotImplementedError``: its KV cache and the one-token decode steps are not split along the sequence); it
    switches SP off itself only for MoE models. Megatron's own ``set_model_to_sequence_parallel`` turns the config
    flag and every module's copy of it (linears, the embedding's reduce-scatter, RoPE's sequence length) off and on
    again. The weights are the same either way; only where the activations are split changes."""
    if not model.config.sequence_parallel:
        yield
        return
    from megatron.core.transformer import utils

    def switch(on: bool) -> None:
        # Megatron caches the modules it switches under id(model) and holds them: forgotten each time, so that a model
        # built later in the process under a freed model's id is not taken for it (and the old one is not kept alive)
        cache = utils._sequence_parallel_attr_cache
        if cache is not None:
            cache.pop(id(model), None)
        utils.set_model_to_sequence_parallel(model, on)
        utils._sequence_parallel_attr_cache.pop(id(model), None)

    switch(False)
    try:
        yield
    finally:
        switch(True)


def generate_static_batch(model: Any, tokenizer: Any, eos_id: int, pad_id: int, prompt_ids: Sequence[Sequence[int]],
                          sampling: SamplingParams, distribution: SampledDistribution) -> Rollout:
    """One static batch of ``prompt_ids`` through Megatron-Core's ``StaticInferenceEngine`` on ``model`` (the bare
    ``GPTModel`` of this rank's pipeline stage) → a ``Rollout`` in the stages' layout, right-padded with ``pad_id``."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

    if not prompt_ids or min(len(p) for p in prompt_ids) < 1:
        raise ValueError("generate: every prompt needs at least one token")
    config = model.config
    longest = max(len(p) for p in prompt_ids) + sampling.max_new_tokens
    wrapper_config = InferenceWrapperConfig(
        hidden_size=config.hidden_size, params_dtype=config.params_dtype, inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=model.vocab_size, inference_max_requests=len(prompt_ids), inference_max_seq_length=longest)
    wrapper = GPTInferenceWrapper(model, wrapper_config, StaticInferenceContext.from_config(wrapper_config))
    controller = _controller_class()(inference_wrapped_model=wrapper, tokenizer=_TokenizerAdapter(tokenizer, eos_id))
    controller.distribution, controller.greedy = distribution, sampling.use_greedy
    engine = StaticInferenceEngine(controller, max_batch_size=len(prompt_ids), legacy=True)
    asked = MegatronSampling(num_tokens_to_generate=sampling.max_new_tokens, termination_id=eos_id)
    ids = [engine.scheduler.add_request(prompt="", prompt_tokens=list(map(int, p)), sampling_params=asked)
           for p in prompt_ids]
    try:
        engine.run_engine()
    finally:
        _drop_inference_mode_buffers()
    done = [engine.scheduler.completed_request_pool[i] for i in ids]
    return _rollout(prompt_ids, [list(map(int, r.generated_tokens.tolist())) for r in done], sampling.max_new_tokens,
                    eos_id, pad_id)


def check_inference_engine(engine: str, kernels: str) -> None:
    """Start-up check of ``model.megatron.inference_engine`` and ``model.megatron.attention_kernels``: ``dynamic``
    attends only through paged-KV kernels — with ``torch`` this module's (bound into Megatron's attention here), with
    ``flash_attn`` the ones Megatron-Core bound at import (flash-attn >= 2.7.3, or flash-attn 3). Refuses in one line
    naming the keys."""
    if engine != "dynamic":
        return
    if kernels == "torch":
        from nemo_factuality.trainers.backends.megatron import paged_attention

        paged_attention.use_torch_kernels()
        return
    from megatron.core.transformer import attention
    from packaging.version import Version

    if attention.HAVE_FA3:
        return
    found = _flash_attn_version()
    if found is None or Version(found) < Version(FLASH_ATTN_MIN_VERSION):
        raise ConfigError(f"model.megatron.inference_engine=dynamic with model.megatron.attention_kernels=flash_attn "
                          f"needs flash-attn >= {FLASH_ATTN_MIN_VERSION} (Megatron-Core's dynamic engine attends only "
                          f"through paged-KV kernels), found {found or 'none importable'}: install flash-attn, or set "
                          "model.megatron.attention_kernels=torch (plain-torch paged attention) or "
                          "model.megatron.inference_engine=static")


def _flash_attn_version() -> str | None:
    """The version of the flash-attn whose kernels Megatron's attention bound, or None (not importable, or not bound)."""
    from megatron.core.transformer import attention

    from nemo_factuality.trainers.backends.megatron import paged_attention

    bound = (attention.flash_attn_varlen_func, attention.flash_attn_with_kvcache)
    if any(k is None or paged_attention.is_torch_kernel(k) for k in bound):
        return None
    try:
        return str(getattr(importlib.import_module("flash_attn"), "__version__", "0"))
    except ImportError:
        return None


def _dynamic_context(model: Any, max_requests: int, max_sequence_length: int, buffer_gb: float, block_tokens: int,
                     max_step_tokens: int | None, cuda_graphs: int, sequence_tokens: int | None = None) -> Any:
    """A ``DynamicInferenceContext`` for this rank's stage of ``model``: its KV cache ``buffer_gb`` of pages of
    ``block_tokens`` tokens, ``max_step_tokens`` per engine step (None: Megatron's default); ``cuda_graphs`` decode
    batch sizes captured as CUDA graphs (0: none; prefill always eager); unified memory and flashinfer's fused RoPE
    off (CUDA-only paths nothing here needs). Refuses a buffer too small for one sequence of ``max_sequence_length``
    (named as ``sequence_tokens``, the length asked for before rounding up to whole pages)."""
    from megatron.core.inference.contexts import DynamicInferenceContext

    config = model.config
    graphs = {"num_cuda_graphs": cuda_graphs, "use_cuda_graphs_for_non_decode_steps": False} if cuda_graphs else {}
    context = DynamicInferenceContext(
        params_dtype=config.params_dtype, num_layers=len(model.decoder.layers), kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups or config.num_attention_heads,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size, max_sequence_length=max_sequence_length,
        buffer_size_gb=buffer_gb, max_requests=max_requests, max_tokens=max_step_tokens,
        block_size_tokens=block_tokens, use_flashinfer_fused_rope=False, unified_memory_level=0, **graphs)
    pages = -(-max_sequence_length // block_tokens)
    if context.block_allocator.total_count - 1 < pages:  # one page is Megatron's dummy block
        need = _round_up((pages + 1) * context.block_size_bytes / 1024**3)  # Megatron's GB are GiB
        held = context.block_allocator.total_count - 1
        raise ConfigError(f"model.megatron.inference_buffer_gb={buffer_gb} holds {held} KV pages of {block_tokens} "
                          f"tokens; one sequence of {sequence_tokens or max_sequence_length} tokens needs {pages}: set "
                          f"it to at least {need:g}")
    return context


def _round_up(value: float, digits: int = 4) -> float:
    """``value`` rounded up to ``digits`` significant digits (a size printed for the user must still be enough)."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(value)))
    return math.ceil(value * scale) / scale


@contextlib.contextmanager
def cuda_graphs_on(model: Any, enabled: bool) -> Iterator[None]:
    """``model``'s CUDA graph managers switched on for the duration (Megatron's ``toggle_cuda_graphs``, the managers
    the build made, so graphs captured once are replayed by every later call), then off: no training forward goes
    through them. A no-op when ``enabled`` is false (CPU, or ``model.megatron.inference_cuda_graphs=0``)."""
    if not enabled:
        yield
        return
    from megatron.core.transformer.utils import toggle_cuda_graphs

    toggle_cuda_graphs(model, set_to="local", reset_cuda_graphs=False)
    try:
        yield
    finally:
        toggle_cuda_graphs(model, set_to="none", reset_cuda_graphs=False)


def drop_cuda_graphs(model: Any) -> None:
    """Forget every CUDA graph ``model``'s layers captured (Megatron-Core's ``delete_cuda_graphs``: the graphs and
    their memory pool) and each layer's graph lookup: a graph manager finds its runner by the padded batch size, so
    after the dynamic engine is rebuilt with a new context an old runner would replay its decode step into the old KV
    buffer. The managers stay (the ones ``toggle_cuda_graphs`` caches): the next decode step captures anew."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager, delete_cuda_graphs

    delete_cuda_graphs()
    for module in model.modules():
        manager = getattr(module, "cudagraph_manager", None)
        if isinstance(manager, CudaGraphManager):
            manager.cudagraph_runners.clear()
            manager.inference_cudagraphs_lookup_table.clear()


class DynamicGenerator:
    """Megatron-Core's ``DynamicInferenceEngine`` on ``model`` (the bare ``GPTModel`` of this rank's pipeline stage),
    built once and reused by every generate call of the run: its inference context (the paged KV buffer, the request
    tables) and, on a GPU, the decode steps' CUDA graphs are made on the first call and kept, each later call only
    resets the engine's requests. The context holds sequences of ``max_sequence_length`` tokens (the stage's longest
    prompt plus response; None: the first call's longest), in whole pages; a call that needs longer ones, or other
    engine settings, builds it again (logged, counted in ``builds``).

    Every rank of a model replica steps the engine in lockstep (the forward's collectives) and sees the same tokens
    (sampled on the source rank), so all of them yield the same chunks."""

    def __init__(self, model: Any, tokenizer: Any, pad_id: int, max_sequence_length: int | None = None) -> None:
        self.model, self.tokenizer, self.pad_id = model, tokenizer, pad_id
        self.max_sequence_length = max_sequence_length
        self.builds = 0
        self._settings: tuple | None = None  # what the held engine was built with
        self._capacity = 0  # the longest sequence its context holds, tokens
        self._engine: Any = None
        self._controller: Any = None

    def _engine_for(self, settings: tuple, longest: int) -> Any:
        """The engine for ``settings`` holding sequences of ``longest`` tokens: the one held, or a new one."""
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

        if self._engine is not None and self._settings == settings and self._capacity >= longest:
            self._engine.reset()  # the last call's requests gone, every page free; graphs and buffers kept
            return self._engine
        requests, eos_id, buffer_gb, block_tokens, max_step_tokens, cuda_graphs = settings
        sequence = max(longest, self.max_sequence_length or 0)
        capacity = -(-sequence // block_tokens) * block_tokens
        model = self.model
        wrapper_config = InferenceWrapperConfig(
            hidden_size=model.config.hidden_size, params_dtype=model.config.params_dtype,
            inference_batch_times_seqlen_threshold=-1, padded_vocab_size=model.vocab_size,
            inference_max_requests=requests, inference_max_seq_length=capacity)
        if self._engine is not None and self._settings is not None and self._settings[-1]:
            drop_cuda_graphs(model)  # the old graphs replay into the old context's KV buffer
        self._engine = self._controller = None  # the old context's buffers go before the new one's are allocated
        context = _dynamic_context(model, requests, capacity, buffer_gb, block_tokens, max_step_tokens, cuda_graphs,
                                   sequence)
        self._controller = _controller_class()(inference_wrapped_model=GPTInferenceWrapper(model, wrapper_config, context),
                                               tokenizer=_TokenizerAdapter(self.tokenizer, eos_id))
        # the engine captures its CUDA graphs here when they are on (the caller holds them on); random_seed is unused:
        # the controller samples with torch's generator
        self._engine = DynamicInferenceEngine(self._controller, context, random_seed=0)
        self._settings, self._capacity, self.builds = settings, capacity, self.builds + 1
        log.info("megatron dynamic engine built (%d): %d requests in flight, sequences up to %d tokens, %s",
                 self.builds, requests, capacity, f"{cuda_graphs} decode CUDA graphs" if cuda_graphs else "no CUDA graphs")
        return self._engine

    def chunks(self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, distribution: SampledDistribution,
               *, eos_id: int, max_requests: int, buffer_gb: float, block_tokens: int = 256,
               max_step_tokens: int | None = None, cuda_graphs: int = 0) -> Iterator[RolloutChunk]:
        """Every prompt of ``prompt_ids`` through the engine, at most ``max_requests`` in flight → ``RolloutChunk`` s
        of ``max_requests`` rows (the last one fewer) in the order the requests finish, each as soon as it is
        complete. The caller holds the model in generation mode (and its CUDA graphs on) while it steps this."""
        from megatron.core.inference.sampling_params import SamplingParams as MegatronSampling

        if not prompt_ids or min(len(p) for p in prompt_ids) < 1:
            raise ValueError("generate: every prompt needs at least one token")
        requests = max(1, max_requests)
        longest = max(len(p) for p in prompt_ids) + sampling.max_new_tokens
        engine = self._engine_for((requests, eos_id, buffer_gb, block_tokens, max_step_tokens, cuda_graphs), longest)
        self._controller.distribution, self._controller.greedy = distribution, sampling.use_greedy
        asked = MegatronSampling(num_tokens_to_generate=sampling.max_new_tokens, termination_id=eos_id)
        for i, prompt in enumerate(prompt_ids):
            engine.add_request(i, list(map(int, prompt)), asked)
        if engine.failed_request_ids:
            raise ValueError(f"generate: Megatron's dynamic engine refused prompt rows {engine.failed_request_ids[:8]}")
        done: list[Any] = []
        try:
            while engine.has_unfinished_requests():
                done += [record.merge() for record in engine.step_modern()["finished_request_records"]]
                while len(done) >= requests or (done and not engine.has_unfinished_requests()):
                    _drop_inference_mode_buffers()  # the stage may train on a chunk before the next step
                    ready, done = done[:requests], done[requests:]
                    yield _dynamic_chunk(prompt_ids, ready, sampling.max_new_tokens, eos_id, self.pad_id)
        finally:
            _drop_inference_mode_buffers()


def _dynamic_chunk(prompt_ids: Sequence[Sequence[int]], finished: list[Any], max_new_tokens: int, eos_id: int,
                   pad_id: int) -> RolloutChunk:
    """Finished dynamic-engine requests (their ids are prompt rows) as a chunk in ``_rollout``'s layout. The dynamic
    engine keeps the EOS that ended a request among its generated tokens; the static engine's layout has it after."""
    rows, generated = [], []
    for request in finished:
        if request.failed():
            raise ValueError(f"generate: Megatron's dynamic engine failed prompt row {request.request_id}: "
                             f"{[str(e) for e in request.events][-1:]}")
        tokens = list(map(int, request.generated_tokens))
        rows.append(int(request.request_id))
        generated.append(tokens[:-1] if tokens and tokens[-1] == eos_id else tokens)
    return RolloutChunk(rows, _rollout([prompt_ids[r] for r in rows], generated, max_new_tokens, eos_id, pad_id))


def _drop_inference_mode_buffers() -> None:
    """Forget the tensors Megatron's global memory buffer allocated during generation. The engine runs in
    ``torch.inference_mode``, so a buffer first allocated there is an inference tensor, and the buffer is shared by
    name: the local attention's score buffer ("mpu") is the one sequence parallelism's all-gathers then fill in place
    during training ("Inplace update to inference tensor outside InferenceMode": the first GRPO step at TP=2 with SP
    failed on it). Allocated again outside inference mode when next needed."""
    from megatron.core import parallel_state

    buffers = parallel_state.get_global_memory_buffer().buffer
    for key in [k for k, tensor in buffers.items() if tensor.is_inference()]:
        del buffers[key]


def _rollout(prompt_ids: Sequence[Sequence[int]], generated: list[list[int]], max_new_tokens: int, eos_id: int,
             pad_id: int) -> Rollout:
    """Megatron's generations (EOS excluded, fewer than ``max_new_tokens`` tokens when EOS ended them) as a Rollout."""
    rows, ends = [], []
    for prompt, tokens in zip(prompt_ids, generated, strict=True):
        ended = len(tokens) < max_new_tokens
        rows.append(list(prompt) + tokens + ([eos_id] if ended else []))
        ends.append(ended)
    out = torch.full((len(rows), max(len(r) for r in rows)), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return Rollout(out, torch.tensor([len(p) for p in prompt_ids]), torch.tensor([len(r) for r in rows]),
                   torch.tensor(ends, dtype=torch.bool))
