"""Building the megatron backend's models (the policy, the critic's value model): Megatron-Core's process groups, a
``GPTModel`` from an HF folder through Megatron-Bridge's ``AutoBridge`` at any TP/PP, Megatron's DDP and optimizer, and
the LR schedule.

Fixes for what Megatron-Bridge 0.3.1 gets silently wrong, on any device (each has a test that would catch it):

* **Row-parallel weights scattered from views** (``param_mapping.py`` ``scatter_to_tp_ranks``): the TP shards of a
  row-parallel weight are ``torch.chunk(dim=1)`` views, and ``dist.scatter`` sends a tensor's storage, not the view.
  On GPU the ``.to("cuda")`` copy hides it; where the weights already sit on the model's device (CPU, or an HF state
  loaded to the GPU) every rank but the first gets the wrong columns — logits off by ~3.7 at TP=2, no error.
  ``contiguous_tensor_parallel_scatter`` makes each shard contiguous before the scatter.
* **Tensor-parallel attributes never set**: Bridge builds with ``perform_initialization=False`` (it loads the HF
  weights afterwards), and Megatron-Core's linear and embedding layers set ``tensor_model_parallel`` on their weights
  only inside their initialisation branch; ``get_model`` then defaults them to "replicated". The gradient norm (and so
  clipping) counts a TP-sharded weight once instead of summing its shards: 1.88 instead of 2.59 at TP=2 on the tiny
  test model. ``set_tensor_parallel_attributes`` sets them on every TP-sharded weight before the model is wrapped.
* **Adam's step after a resume** (Megatron-Core 0.16.1's distributed optimizer with torch's AdamW, i.e. without TE or
  Apex): its ``load_state_dict`` puts one and the same step tensor on every parameter, which torch's foreach AdamW
  then increments once per parameter (step 2 becomes step 1 + #parameters: the bias correction, and so every update
  after the resume, silently wrong; here the update after a save/load moved weights by 3.5e-3 more than without the
  save/load), and it cannot load its own checkpoint's parameter state without ``step`` (KeyError):
  ``load_optimizer_state``.
* **Norms under sequence parallelism** (the local spec): Megatron-Core 0.16.1 builds every norm of an RMSNorm model as
  ``WrappedTorchNorm``, which asserts SP off, because its weights are not marked ``sequence_parallel`` and their
  gradients would stay partial sums over each rank's part of the sequence (2.1% gradient error, the norms' 60%, with
  the gradient norm 3e-4 off). ``local_block_spec`` builds the layers and the final norm with ``SequenceParallelTorchNorm``.
* **The fused cross-entropy** rounds the logits' gradient to bf16 (~0.1% gradient error): off
  (``cross_entropy_loss_fusion``); this backend computes its log-probs itself anyway.

Importing this module imports nothing from Megatron; the functions import it when called.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_factuality.config import ConfigError
from nemo_factuality.trainers.backends.hf.actor import lr_factor
from nemo_factuality.trainers.backends.memory import ParallelLayout
from nemo_factuality.types import FactualityInputError

log = logging.getLogger(__name__)

_BRIDGE_HINT = ("megatron-bridge 0.3.1 imports transformer_engine.pytorch unconditionally (megatron/bridge/peft/"
                "lora_layers.py): install Transformer Engine (the NGC PyTorch container has it; docs/cluster/megatron.md); "
                "on a machine without a GPU, `bash tools/gpu_smoke.sh --cpu --backend megatron --skip-trl` runs this "
                "backend on CPU")


def import_auto_bridge() -> Any:
    """``megatron.bridge.AutoBridge``, or one line saying what is missing."""
    try:
        from megatron.bridge import AutoBridge
    except ImportError as err:
        if "transformer_engine" in str(err):
            raise ImportError(f"{_BRIDGE_HINT} ({err})") from err
        raise ImportError(f"trainer.backend=megatron needs megatron-core 0.16 and megatron-bridge 0.3 "
                          f"(requirements/megatron.txt): {err}") from err
    return AutoBridge


@dataclass(frozen=True)
class Settings:
    """The ``model.*`` settings that reach Megatron's configs (the provider's ``TransformerConfig``, the DDP config and
    the ``OptimizerConfig``)."""

    bf16: bool = False  # model.dtype=bfloat16: bf16 weights/activations, fp32 main weights, fp32 gradient reduction
    sequence_parallel: bool = False
    recompute: str = "none"  # none | full | selective
    transformer_engine: bool = False  # Megatron-Core's TE layer spec instead of the local one
    distributed_optimizer: bool = False
    optimizer_checkpoint: str = "dp_reshardable"  # the distributed optimizer's checkpoint format (model.OPTIMIZER_FORMATS)
    # the dynamic engine's decode steps as CUDA graphs (a GPU, inference_engine=dynamic, inference_cuda_graphs > 0):
    # the layers get Megatron's graph managers at build, switched on only while generating; the RNG graph-safe
    cuda_graphs: bool = False
    # Megatron's gloo data-parallel groups built (model.megatron.use_gloo_process_groups; null: the distributed
    # optimizer saving fully_reshardable, their only user). Each costs a gloo rendezvous per group at start-up and
    # needs GLOO_SOCKET_IFNAME across nodes
    gloo_process_groups: bool = False

    @classmethod
    def of(cls, model: Any, *, on_gpu: bool = False) -> Settings:
        """From a stage's ``model`` config (``PolicyModelConfig``); ``on_gpu``: the trainer's device is CUDA (CUDA
        graphs exist only there)."""
        m = model.megatron
        graphs = on_gpu and m.inference_engine == "dynamic" and m.inference_cuda_graphs > 0
        gloo = m.saves_over_gloo if m.use_gloo_process_groups is None else m.use_gloo_process_groups
        return cls(bf16=model.dtype == "bfloat16", sequence_parallel=m.sequence_parallel, recompute=m.recompute,
                   transformer_engine=m.transformer_engine, distributed_optimizer=m.use_distributed_optimizer,
                   optimizer_checkpoint=m.optimizer_checkpoint, cuda_graphs=graphs, gloo_process_groups=gloo)

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16 else torch.float32


def init_process_groups(tensor: int, pipeline: int, device: str, seed: int, timeout_s: float, *,
                        cudagraphable_rng: bool = False, gloo: bool = False) -> ParallelLayout:
    """torch.distributed (gloo on CPU, NCCL on GPU; one process: a single-rank group) and Megatron-Core's groups, each
    timing out after ``timeout_s`` (``trainer.distributed_timeout_s``; Megatron counts whole minutes, rounded up), with
    its gloo data-parallel groups only if ``gloo`` (``Settings.gloo_process_groups``); Megatron's model-parallel RNG
    seeded (graph-safe with ``cudagraphable_rng``: CUDA graphs replay its draws). A second model in the same process
    must ask for the same layout, and for gloo groups only if the first built them."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not torch.distributed.is_initialized():
        from nemo_factuality.trainers.backends.collectives import (
            adopt_slurm_ranks,
            group_timeout,
            init_from_environment,
        )

        adopt_slurm_ranks()  # one srun task per GPU (the launcher's megatron jobs) as well as torchrun
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            init_from_environment(device, timeout_s)
        else:  # Megatron-Core needs process groups even alone
            torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                                 store=torch.distributed.HashStore(), rank=0, world_size=1,
                                                 timeout=group_timeout(timeout_s))
    world = torch.distributed.get_world_size()
    if world % (tensor * pipeline):
        raise ConfigError(f"{world} processes do not split into model replicas of model.tensor_model_parallel_size="
                          f"{tensor} × model.pipeline_model_parallel_size={pipeline}")
    if parallel_state.model_parallel_is_initialized():
        held = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size())
        if held != (tensor, pipeline):
            raise ConfigError(f"this process already holds Megatron groups at TP×PP={held[0]}×{held[1]}; "
                              f"model.tensor_model_parallel_size / pipeline_model_parallel_size ask for {tensor}×{pipeline}")
        if gloo and not gloo_process_groups_built():
            raise ConfigError("this process already holds Megatron groups without gloo data-parallel groups; "
                              "model.megatron.use_gloo_process_groups asks for them: build the first model with it")
    else:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline,
                                                 distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
                                                 create_gloo_process_groups=gloo)
        model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cudagraphable_rng)
    return ParallelLayout(tensor, pipeline, parallel_state.get_data_parallel_world_size())


def gloo_process_groups_built() -> bool:
    """Whether this process's Megatron groups include the gloo data-parallel groups (Megatron's getters assert)."""
    from megatron.core import parallel_state

    try:
        parallel_state.get_data_parallel_group_gloo(with_context_parallel=True)
        parallel_state.get_data_parallel_group_gloo(with_context_parallel=False)
    except AssertionError:
        return False
    return True


def contiguous_tensor_parallel_scatter() -> None:
    """Make Bridge scatter contiguous TP shards (see the module docstring). Idempotent."""
    from megatron.bridge.models.conversion.param_mapping import MegatronParamMapping

    scatter = MegatronParamMapping.scatter_to_tp_ranks
    if getattr(scatter, "scatters_contiguous_shards", False):
        return

    def scatter_contiguous(self, splits, output_shape, dtype, device, src_rank=0):
        splits = [s.contiguous() for s in splits] if splits else splits
        return scatter(self, splits, output_shape, dtype, device, src_rank)

    scatter_contiguous.scatters_contiguous_shards = True
    MegatronParamMapping.scatter_to_tp_ranks = scatter_contiguous


def set_tensor_parallel_attributes(model_chunks: list[Any]) -> list[Any]:
    """Mark the weights of Megatron-Core's column-/row-parallel linears and vocab-parallel embeddings as TP-sharded
    (along the output / input / vocab dimension) where Bridge's build left them unset; a Bridge pre-wrap hook."""
    from megatron.core import tensor_parallel

    sharded_along = {tensor_parallel.ColumnParallelLinear: 0, tensor_parallel.RowParallelLinear: 1,
                     tensor_parallel.VocabParallelEmbedding: 0}
    marked = 0
    for chunk in model_chunks:
        for module in chunk.modules():
            dim = next((d for cls, d in sharded_along.items() if isinstance(module, cls)), None)
            weight = getattr(module, "weight", None)
            if dim is None or not isinstance(weight, torch.nn.Parameter) or getattr(weight, "tensor_model_parallel", False):
                continue
            # the attributes may exist already with the "replicated" defaults: set them, not only when missing
            weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride = True, dim, 1
            marked += 1
    log.debug("set tensor-parallel attributes on %d weights", marked)
    return model_chunks


def tensor_parallel_weights_unmarked(model_chunks: list[Any]) -> list[str]:
    """Weights of TP-sharded layers that are not marked TP-sharded (the gradient norm would count them once)."""
    from megatron.core import tensor_parallel

    layers = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear,
              tensor_parallel.VocabParallelEmbedding)
    return [name for chunk in model_chunks for name, module in chunk.named_modules()
            if isinstance(module, layers) and isinstance(getattr(module, "weight", None), torch.nn.Parameter)
            and not getattr(module.weight, "tensor_model_parallel", False)]


def transformer_engine_available() -> bool:
    from megatron.core.extensions import transformer_engine

    return bool(getattr(transformer_engine, "HAVE_TE", False))


class SequenceParallelTorchNorm:
    """torch's ``LayerNorm`` / ``RMSNorm`` (``config.normalization``), built as Megatron-Core's ``WrappedTorchNorm``
    builds them, with every parameter marked ``sequence_parallel`` as TE's and Apex's norms mark theirs.

    Megatron-Core 0.16.1's local spec always takes ``WrappedTorchNorm`` for RMSNorm models (and for LayerNorm ones
    without Apex), which asserts ``not config.sequence_parallel``: under SP a norm sees only this rank's part of the
    sequence, so its weight's gradient is a partial sum that ``finalize_model_grads`` must all-reduce over TP — which
    it does only for parameters marked ``sequence_parallel``. An unmarked norm would give silently wrong gradients."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_spec_arguments: Any) -> torch.nn.Module:
        norms = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in norms or config.layernorm_zero_centered_gamma or config.persist_layer_norm:
            raise ConfigError(f"normalization {config.normalization!r} (zero-centred or persistent) has no local "
                              "implementation here: set model.megatron.transformer_engine=true")
        norm = norms[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _replace_module(spec: Any, old: type, new: type) -> Any:
    """``spec`` (a ``ModuleSpec`` tree of submodule dataclasses) with every ``old`` module class replaced by ``new``."""
    import dataclasses

    if spec is old:
        return new
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        return dataclasses.replace(spec, **{f.name: _replace_module(getattr(spec, f.name), old, new)
                                            for f in dataclasses.fields(spec) if f.init})
    return spec


def local_block_spec(config: Any, vp_stage: int | None = None) -> Any:
    """Megatron-Core's local layer spec (Bridge's ``local_layer_spec``) as a whole decoder block whose norms — the
    layers' and the final one, which Megatron would otherwise pick from what is installed — are
    ``SequenceParallelTorchNorm``. Numerically the same norms as the local spec's; a Bridge layer-spec callable."""
    from megatron.bridge.models.gpt_provider import local_layer_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = _replace_module(local_layer_spec(config), WrappedTorchNorm, SequenceParallelTorchNorm)
    block = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                       layer_norm=SequenceParallelTorchNorm)
    # Bridge's provider sets the local attention class through ``spec.submodules.self_attention`` (it assumes a layer
    # spec): give it the layers' own (it sets the class they already have)
    block.self_attention = layer.submodules.self_attention
    return ModuleSpec(module=TransformerBlock, submodules=block)


# model.megatron.recompute → Megatron's (recompute_granularity, recompute_method, recompute_num_layers)
_RECOMPUTE = {"none": (None, None, None), "full": ("full", "uniform", 1), "selective": ("selective", None, None)}


def check_heads_split(heads: int, kv_heads: int, tp: int) -> None:
    """Megatron-Core 0.16's own rule for TP, checked before its config raises a traceback: TP divides the attention
    heads, and the KV heads (query groups) are a multiple of TP or a divisor of it (then the ranks sharing a KV head
    all-gather the QKV projection). SmolLM2's 9 heads / 3 KV heads: TP 1, 3 or 9, never 2."""
    def fits(n: int) -> bool:
        return heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)

    if not fits(tp):
        raise ConfigError(f"the checkpoint's {heads} attention heads / {kv_heads} KV heads do not split over "
                          f"model.tensor_model_parallel_size={tp} (Megatron-Core needs TP to divide the heads, and the "
                          f"KV heads to be a multiple or a divisor of TP): choose one of "
                          f"{[n for n in range(1, heads + 1) if fits(n)]}")


def configure_provider(provider: Any, layout: ParallelLayout, settings: Settings) -> Any:
    """Bridge's ``GPTModelProvider`` at ``layout`` with ``settings`` and this backend's loss accounting: the TE layer
    spec, or Megatron-Core's local one (``local_block_spec``) with the fusions that need Apex/TE/CUDA kernels off."""
    provider.tensor_model_parallel_size = layout.tp
    provider.pipeline_model_parallel_size = layout.pp
    provider.sequence_parallel = settings.sequence_parallel
    provider.params_dtype = provider.autocast_dtype = provider.pipeline_dtype = settings.dtype
    provider.bf16, provider.fp16 = settings.bf16, False
    recompute = _RECOMPUTE[settings.recompute]
    # Megatron-Core 0.16 asserts that full recompute goes only with full-iteration CUDA graphs; here the graphs are the
    # dynamic engine's decode steps (inference, where TransformerBlock never recomputes) and full recompute is the
    # training forward's (TransformerBlock.forward reads config.recompute_granularity then, with self.training): each
    # where it applies, the recompute settings given after the config's validation
    deferred = settings.cuda_graphs and recompute[0] == "full"
    provider.recompute_granularity, provider.recompute_method, provider.recompute_num_layers = \
        (None, None, None) if deferred else recompute
    # the stage's losses are normalised by the global counts: the schedule must neither divide a micro batch's loss by
    # the number of micro batches nor DDP average over data-parallel ranks (both skip that with this flag, and this
    # backend never hands the schedule a token count to divide by)
    provider.calculate_per_token_loss = True
    if settings.cuda_graphs:  # graph managers on every layer; build_model switches them off until generation
        provider.cuda_graph_impl = "local"
    provider.cross_entropy_loss_fusion = False  # rounds the logits' gradient to bf16; unused by the log-probs anyway
    if settings.transformer_engine:
        if not transformer_engine_available():
            raise ConfigError("model.megatron.transformer_engine=true but Transformer Engine is not importable here "
                              "(the NGC PyTorch container has it): install it or set model.megatron.transformer_engine=false")
        from megatron.bridge.models.gpt_provider import transformer_engine_layer_spec

        provider.transformer_layer_spec = transformer_engine_layer_spec
    else:
        from megatron.core.transformer.enums import AttnBackend

        provider.transformer_layer_spec = local_block_spec
        provider.attention_backend = AttnBackend.local
        # each needs Apex/TE or CUDA kernels (or torch.compile's C++ toolchain on CPU)
        for fusion in ("gradient_accumulation_fusion", "masked_softmax_fusion", "bias_activation_fusion",
                       "bias_dropout_fusion", "apply_rope_fusion", "persist_layer_norm"):
            setattr(provider, fusion, False)
    check_heads_split(provider.num_attention_heads, provider.num_query_groups or provider.num_attention_heads, layout.tp)
    provider.finalize()
    if deferred:
        provider.recompute_granularity, provider.recompute_method, provider.recompute_num_layers = recompute
    if provider.vocab_size % layout.tp:
        raise ConfigError(f"the checkpoint's vocabulary ({provider.vocab_size}) does not split over "
                          f"model.tensor_model_parallel_size={layout.tp}")
    return provider


def in_installed_config_layout(path: str) -> Path:
    """``path``, or a folder of links to its files with ``config.json`` rewritten in the layout this venv's transformers
    reads. transformers 5 writes RoPE inside ``rope_parameters``; the 4.57 that Bridge needs reads only the top-level
    ``rope_theta`` and silently falls back to 10000 (a Qwen2.5 checkpoint's 1e6 lost: every logit changes)."""
    import json
    import tempfile

    from nemo_factuality.convert.hf_config import to_installed_layout

    src = Path(path)
    cfg = json.loads((src / "config.json").read_text())
    fixed = to_installed_layout(cfg)
    if fixed == cfg:
        return src
    view = Path(tempfile.mkdtemp(prefix="megatron_hf_view_"))
    for item in src.iterdir():
        if item.name != "config.json":
            (view / item.name).symlink_to(item.resolve())
    (view / "config.json").write_text(json.dumps(fixed, indent=2))
    log.info("%s/config.json is in another transformers layout than this venv's: read through %s", src, view)
    return view


def check_rope(provider: Any, path: str) -> None:
    """The built model's RoPE base is the checkpoint's (read from either config layout), or a one-line error."""
    import json

    from nemo_factuality.convert.hf_config import read_rope

    want = read_rope(json.loads((Path(path) / "config.json").read_text())).theta
    got = float(getattr(provider, "rotary_base", want))
    if not math.isclose(got, want, rel_tol=1e-9):
        raise FactualityInputError(f"{path}: Megatron-Bridge built the model with rope_theta {got:g} but the "
                                   f"checkpoint's config.json says {want:g}")


def build_model(path: str, layout: ParallelLayout, settings: Settings, *, on_gpu: bool,
                after_load: Callable[[list[Any]], list[Any]] | None = None) -> tuple[Any, list[Any]]:
    """(the ``AutoBridge`` of ``path``, this rank's model chunks — Megatron's DDP around, with bf16, its
    ``Float16Module`` around the ``GPTModel`` — with the HF weights). ``after_load(chunks)`` changes the unwrapped
    chunks once the weights are in, before DDP allocates the gradient buffers (the critic puts its value head in place
    of the output layer)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.module import Float16Module

    source = in_installed_config_layout(path)
    bridge = import_auto_bridge().from_hf_pretrained(str(source), torch_dtype=torch.float32)
    contiguous_tensor_parallel_scatter()
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.register_pre_wrap_hook(set_tensor_parallel_attributes, prepend=True)
    if after_load is not None:
        provider.register_pre_wrap_hook(after_load)  # after Bridge's weight loading, which is a pre-wrap hook too
    check_rope(provider, path)
    configure_provider(provider, layout, settings)
    # gradients accumulate and are reduced over DP in fp32 buffers (``main_grad``) in bf16 too
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                        use_distributed_optimizer=settings.distributed_optimizer)
    chunks = provider.provide_distributed_model(
        ddp_config=ddp, wrap_with_ddp=True, data_parallel_random_init=False, use_cpu_initialization=not on_gpu,
        mixed_precision_wrapper=Float16Module,  # applied only with bf16: bf16 weights, inputs cast, fp32 logits out
        pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    config = chunks[0].config
    # this backend reduces the gradients itself (finalize_model_grads without a token count): nothing in the schedule
    config.finalize_model_grads_func = config.grad_scale_func = None
    config.no_sync_func = config.grad_sync_func = config.param_sync_func = None
    unmarked = tensor_parallel_weights_unmarked(chunks)
    if unmarked:
        raise RuntimeError(f"TP-sharded weights not marked tensor-parallel after the build: {unmarked[:4]}")
    if settings.cuda_graphs:  # off for training: generate.cuda_graphs_on switches them on around each engine step
        from megatron.core.transformer.utils import toggle_cuda_graphs

        toggle_cuda_graphs(bare_model(chunks[0]), set_to="none", reset_cuda_graphs=False)
    return bridge, chunks


def bare_model(chunk: Any) -> Any:
    """The ``GPTModel`` inside a model chunk's wrappers (Megatron's DDP, and ``Float16Module`` with bf16)."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def build_optimizer(chunks: list[Any], optim: Any, settings: Settings, *, clip_grad: float) -> Any:
    """Megatron's optimizer for ``model.optim`` (adamw → Megatron's Adam with decoupled weight decay; sgd without
    momentum, as the hf backend's). Megatron leaves biases and norms out of weight decay. With bf16 it keeps fp32 main
    weights (and fp32 main gradients) and steps those, casting them back to the bf16 weights."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    common = dict(lr=optim.lr, min_lr=optim.sched.min_lr, weight_decay=optim.weight_decay, bf16=settings.bf16,
                  fp16=False, params_dtype=settings.dtype, main_grads_dtype=torch.float32,
                  main_params_dtype=torch.float32, use_distributed_optimizer=settings.distributed_optimizer,
                  clip_grad=clip_grad if clip_grad > 0 else 0.0)
    if optim.name == "adamw":
        config = OptimizerConfig(optimizer="adam", adam_beta1=optim.betas[0], adam_beta2=optim.betas[1],
                                 adam_eps=optim.eps, decoupled_weight_decay=True, **common)
    elif optim.name == "sgd":
        config = OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, **common)  # Megatron's default momentum is 0.9
    else:
        raise ConfigError(f"model.optim.name={optim.name!r}: trainer.backend=megatron supports adamw | sgd")
    optimizer = get_megatron_optimizer(config, chunks, use_gloo_process_groups=settings.gloo_process_groups)
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        # Megatron-Core 0.16.1 leaves SGD's state initialiser None, then calls it to build a checkpoint's loading
        # template (TypeError on every resume); SGD without momentum has no state to initialise
        if getattr(megatron_optimizer, "init_state_fn", False) is None:
            megatron_optimizer.init_state_fn = lambda opt, config=None: None
    return optimizer


def _torch_adams(optimizer: Any) -> list[Any]:
    """The Megatron optimizers of ``optimizer`` that wrap torch's Adam/AdamW (what Megatron builds without TE or Apex)."""
    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer])
            if isinstance(getattr(o, "optimizer", None), torch.optim.Adam | torch.optim.AdamW)]


def initialize_adam_state(optimizer: Any) -> None:
    """Give a distributed optimizer's Adam the state it has after a step when it has none (a fresh process, a save
    before the first step): Megatron-Core 0.16.1 describes a checkpoint from the state it finds, so an empty one is
    written without moments (and a loading template then expects them) or, with torch's AdamW, asserts that every
    parameter has a step. torch's Adam: zero moments, step 0, a tensor per parameter. TE/Apex's FusedAdam (the
    container's; its step is in the parameter group): Megatron's own initialiser of it, zero moments."""
    torch_adams = _torch_adams(optimizer)
    for megatron_optimizer in torch_adams:
        adam = megatron_optimizer.optimizer
        for group in adam.param_groups:
            for p in group["params"]:
                if not adam.state[p]:
                    adam.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p.data),
                                         exp_avg_sq=torch.zeros_like(p.data))
    for megatron_optimizer in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(megatron_optimizer, "init_state_fn", None)
        inner = getattr(megatron_optimizer, "optimizer", None)
        if megatron_optimizer not in torch_adams and init is not None and inner is not None:
            init(inner, megatron_optimizer.config)  # fills only parameters without state


@torch.no_grad()  # Megatron's dp_reshardable loader copies into the main weights, which in fp32 are views of the
# parameters: an in-place copy with autograd on fails (a view of a leaf that requires grad)
def load_optimizer_state(optimizer: Any, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, working around Megatron-Core 0.16.1's distributed optimizer with torch's
    AdamW (what it builds without TE or Apex, whose FusedAdam keeps Adam's step in the parameter group): its
    ``load_state_dict`` first puts the checkpoint's step on every parameter's state — one tensor shared by all — then
    copies every key of that state from the checkpoint's parameter state, which holds only ``param``, ``exp_avg``,
    ``exp_avg_sq`` (KeyError on ``step``, fully_reshardable) or the shared tensor itself (dp_reshardable). Here the
    parameter state is loaded with the step set aside, then the step is put back — one tensor per parameter (module
    docstring)."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if "param_state" not in state or not _torch_adams(optimizer):
        optimizer.load_state_dict(state)
        return
    loaders = {"fully_reshardable": "load_parameter_state_from_fully_reshardable",
               "dp_reshardable": "load_parameter_state_from_dp_reshardable"}
    kind = state.get("param_state_sharding_type")
    if len(chained) != 1 or kind not in loaders:
        raise RuntimeError(f"expected one distributed optimizer with a checkpoint in one of {sorted(loaders)}, got "
                           f"{len(chained)} optimizers and {kind!r}")
    distributed, param_state = chained[0], state.pop("param_state")
    state.pop("param_state_sharding_type")
    distributed.load_state_dict(state)  # parameter groups, and Adam's step on every parameter's state
    steps = {id(p): s.pop("step") for p, s in distributed.optimizer.state.items() if "step" in s}
    getattr(distributed, loaders[kind])(param_state)
    for p, s in distributed.optimizer.state.items():
        if id(p) in steps:
            # a tensor of its own: Megatron hands every parameter the same one, which torch's foreach AdamW then
            # advances once per parameter — every later bias correction silently wrong
            s["step"] = steps[id(p)].clone()


class LearningRateSchedule:
    """Every backend's schedule (``hf.lr_factor``: warm-up, then constant or cosine) set on Megatron's optimizer's
    parameter groups before each step; its state is the number of steps taken."""

    def __init__(self, optimizer: Any, optim: Any, max_steps: int) -> None:
        self.optimizer, self.optim, self.max_steps, self.steps = optimizer, optim, max_steps, 0
        self._apply()

    def current_lr(self) -> float:
        return self.optim.lr * lr_factor(self.optim, self.max_steps, self.steps)

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()

    def step(self) -> None:
        self.steps += 1
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])
        self._apply()
