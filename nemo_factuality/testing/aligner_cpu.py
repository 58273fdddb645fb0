"""Test support: run NeMo 2.2 + NeMo-Aligner 0.7.0 actors on a CPU-only torch with gloo.

Never imported by production code. Called first thing in a test program that runs in the Aligner venv
(``tools/setup_aligner_env.sh``), before NeMo builds a model. On a machine with CUDA it does nothing.

What it replaces, each a failure observed on CPU (shared/specs/aligner_actor_cpu.md):

* Megatron-Core's CUDA RNG/device calls: ``nemo_factuality.convert.cpu.apply()`` (the converter's shims).
* ``device="cuda"`` literals and ``torch.cuda.*Tensor`` constructors across Megatron, NeMo and Aligner
  (causal masks, ``clip_grads``, ``Timer``, text generation): tensor factories and ``Tensor.to`` map a
  CUDA device to the CPU; ``Module.cuda()`` (``ModelPT.cuda`` in ``generate``) is the identity;
  ``torch.cuda.Stream`` is inert.
* Transformer Engine / Apex: a TE stub so Megatron picks the local layer spec; Apex-only names NeMo
  uses (``FusedLayerNorm``, ``MixedFusedRMSNorm``, ``listify_model``, ``amp_C.multi_tensor_l2norm``).
* ``nemo_aligner.utils.trt_llm`` imports tensorrt_llm → tensorrt → mpi4py (stubbing those breaks
  Lightning's MPI detection): the module is replaced by one whose ``GPTGenerateTRTLLM`` raises.
* ``pin_memory=True`` host copies (the critic's CPU weight copy) need an accelerator: made unpinned.
* gloo: ``all_gather`` / ``all_gather_into_tensor`` of 0-dim tensors (NCCL accepts them, gloo does not), e.g.
  ``rebalance_nd_tensor`` in ``ReinforceTrainer`` and the critic server's inference.
* Apex's distributed Adam classes that NeMo's checkpointing isinstance-checks; megatron-core 0.12's async
  checkpoint writer against torch 2.13's ``_write_item`` signature.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import types

import torch

_APPLIED = False
_IMPORT_BEFORE_WRAPPING = (
    "megatron.core.models.gpt", "megatron.core.transformer.utils", "megatron.core.fusions.fused_bias_gelu",
    "megatron.core.fusions.fused_bias_swiglu", "nemo.collections.nlp.modules.common.text_generation_utils",
    "nemo_aligner.models.nlp.gpt.megatron_gpt_reinforce_actor", "nemo_aligner.utils.distributed",
    "nemo_aligner.utils.train_utils", "nemo_aligner.utils.utils",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "linspace", "tril", "triu", "eye")


def _cpu_device(device):
    if device == "cuda" or (isinstance(device, str) and device.startswith("cuda:")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int):  # torch.cuda.current_device() style ordinals
        return "cpu"
    return device


def _device_to_cpu(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):  # Aligner's CPU weight copies pin host memory, which needs an accelerator
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


def _tensor_to(original):
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        if args and not isinstance(args[0], torch.dtype) and not torch.is_tensor(args[0]):
            args = (_cpu_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _cuda_type_names(original):
    """``t.type()`` names a CPU tensor as its CUDA twin (``torch.cuda.BFloat16Tensor``): the optimizers that wrap
    fp16/bf16 parameters with fp32 main copies (NeMo's ``MainParamsOptimizerWrapper``, Megatron's
    ``DistributedOptimizer``) accept only those names. ``t.type(dtype)`` (a conversion) is untouched."""

    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


class _TypedTensorMeta(type):
    """``torch.cuda.FloatTensor(data)`` / ``(n, m)`` builds a CPU tensor of that dtype, and
    ``isinstance(t, torch.cuda.FloatTensor)`` (NeMo's clip_grads) holds for CPU tensors of that dtype."""

    dtype: torch.dtype

    def __call__(cls, *args):
        if len(args) == 1 and not isinstance(args[0], int):
            return torch.as_tensor(args[0], dtype=cls.dtype)
        return torch.empty(*args, dtype=cls.dtype)

    def __instancecheck__(cls, obj):
        return torch.is_tensor(obj) and obj.dtype == cls.dtype


def _typed_constructor(dtype: torch.dtype):
    return _TypedTensorMeta(f"Cpu{dtype}Tensor", (), {"dtype": dtype})


def _patch_torch_devices() -> None:
    for name in _FACTORIES:
        setattr(torch, name, _device_to_cpu(getattr(torch, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.type = _cuda_type_names(torch.Tensor.type)
    torch.nn.Module.cuda = lambda self, *a, **k: self
    for name, dtype in (("FloatTensor", torch.float32), ("LongTensor", torch.int64), ("IntTensor", torch.int32),
                        ("BoolTensor", torch.bool), ("HalfTensor", torch.float16), ("BFloat16Tensor", torch.bfloat16),
                        ("ByteTensor", torch.uint8), ("DoubleTensor", torch.float64)):
        setattr(torch.cuda, name, _typed_constructor(dtype))

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def synchronize(self):
            pass

    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: __import__("contextlib").nullcontext()
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None


def _stub_transformer_engine() -> None:
    """Megatron decides HAVE_TE when these import; NeMo's spec files then import TE names it never builds."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer  # noqa: F401

    class _NoTransformerEngine:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Transformer Engine is not installed")

    stub = types.ModuleType("megatron.core.extensions.transformer_engine")
    stub.__getattr__ = lambda name: _NoTransformerEngine
    sys.modules.setdefault("megatron.core.extensions.transformer_engine", stub)


def _stub_trt_llm() -> None:
    stub = types.ModuleType("nemo_aligner.utils.trt_llm")

    class GPTGenerateTRTLLM:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("TensorRT-LLM is not installed in this CPU test environment: set trt_llm.enable=false")

    stub.GPTGenerateTRTLLM = GPTGenerateTRTLLM
    sys.modules["nemo_aligner.utils.trt_llm"] = stub


def _multi_tensor_l2norm(_chunk, _overflow_buf, tensor_lists, per_tensor):
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensor_lists[0]]))
    return norm, None


def _patch_apex_names() -> None:
    """NeMo's Megatron utils and clip_grads import these from Apex; they are only looked up, never needed on CPU."""
    import nemo.collections.nlp.modules.common.megatron.utils as megatron_utils

    for name in ("FusedLayerNorm", "FastLayerNorm", "MixedFusedRMSNorm"):
        if not hasattr(megatron_utils, name):
            setattr(megatron_utils, name, type(name, (torch.nn.Module,), {}))
    if not hasattr(megatron_utils, "listify_model"):
        megatron_utils.listify_model = lambda model: model if isinstance(model, list) else [model]
    import nemo.collections.nlp.modules.common.megatron.clip_grads as clip_grads

    clip_grads.amp_C = types.SimpleNamespace(multi_tensor_l2norm=_multi_tensor_l2norm,
                                             multi_tensor_scale=_multi_tensor_scale)
    clip_grads.multi_tensor_applier = lambda op, buf, lists, *args: op(2048 * 32, buf, lists, *args)


def _multi_tensor_scale(_chunk, _overflow_buf, tensor_lists, scale):
    for src, dst in zip(*tensor_lists, strict=True):
        dst.copy_(src * scale)


def _patch_nemo_model_building() -> None:
    import nemo.collections.nlp.models.language_modeling.megatron_gpt_model as gpt_module
    import nemo.collections.nlp.modules.common.megatron.build_model as build_module
    import nemo.collections.nlp.parts.nlp_overrides as nlp_overrides
    from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes

    nlp_overrides.HAVE_APEX = True  # the strategy refuses to start without Apex; nothing here calls it
    # imported together with Apex's distributed Adam (absent here); checkpointing isinstance-checks them. NeMo's
    # wrapper of Megatron-Core's distributed optimizer needs no Apex: the real class, so its checkpoints shard.
    from nemo.core.optim.mcore_optim import McoreDistributedOptimizer

    if not hasattr(nlp_overrides, "McoreDistributedOptimizer"):
        nlp_overrides.McoreDistributedOptimizer = McoreDistributedOptimizer
    if not hasattr(nlp_overrides, "MegatronDistributedFusedAdam"):
        nlp_overrides.MegatronDistributedFusedAdam = type("MegatronDistributedFusedAdam", (), {})
    build_module.set_defaults_if_not_set_tensor_model_parallel_attributes = set_defaults_if_not_set_tensor_model_parallel_attributes
    # get_specs builds every spec eagerly (TE ones included); without TE only the local spec exists
    gpt_module.get_specs = lambda *args, **kwargs: gpt_module.get_gpt_layer_local_spec(None, False)


def _gloo_safe_all_gather() -> None:
    """gloo rejects 0-dim tensors in all_gather / all_gather_into_tensor (NCCL takes them): gather them as
    1-element tensors."""
    original = torch.distributed.all_gather

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, *args, **kwargs):
        if tensor.dim() == 0:
            flat = [t.view(1) for t in tensor_list]
            return original(flat, tensor.view(1), *args, **kwargs)
        return original(tensor_list, tensor, *args, **kwargs)

    torch.distributed.all_gather = all_gather
    original_into = torch.distributed.all_gather_into_tensor

    @functools.wraps(original_into)
    def all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs):
        # ReinforceTrainer's rebalance_nd_tensor gathers each rank's 0-dim sample count this way
        if input_tensor.dim() == 0:
            input_tensor = input_tensor.view(1)
        return original_into(output_tensor, input_tensor, *args, **kwargs)

    torch.distributed.all_gather_into_tensor = all_gather_into_tensor


def _patch_checkpoint_writer() -> None:
    """megatron-core 0.12's async checkpoint writer calls torch's ``_write_item`` without the
    ``serialization_format`` argument that torch ≥ 2.7 requires (the venv pairs it with torch 2.13)."""
    import inspect

    import megatron.core.dist_checkpointing.strategies.filesystem_async as fs_async
    from torch.distributed.checkpoint import filesystem

    if "serialization_format" not in inspect.signature(filesystem._write_item).parameters:
        return
    fs_async._write_item = functools.partial(_write_item_torch_save, filesystem._write_item)


def _write_item_torch_save(write_item_fn, *args):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    return write_item_fn(*args, SerializationFormat.TORCH_SAVE)


def _no_fp8_quantize_without_te() -> None:
    """megatron-core 0.12's distributed optimizer calls ``quantize_param_shard`` after every step, and without
    Transformer Engine that raises even when no parameter is fp8 (the lists are empty): quantize nothing then."""
    import megatron.core.fp8_utils as fp8_utils

    original = fp8_utils._quantize_param_shard_impl

    def quantize(model_params, *args, **kwargs):
        if len(model_params) == 0:
            return None
        return original(model_params, *args, **kwargs)

    fp8_utils._quantize_param_shard_impl = quantize


def _torch_adam_step_on_load() -> None:
    """megatron-core 0.12's distributed optimizer falls back to torch's AdamW without Apex/TE, and its checkpoint
    load mishandles that AdamW's per-parameter ``step`` twice (so a resumed run would step differently):

    * ``load_state_dict`` gives every parameter's state the *same* step tensor, which torch's AdamW then
      increments once per parameter on the next step (Adam's bias correction goes wrong): each gets its own copy;
    * the fully-sharded load copies every per-parameter state tensor from the checkpoint, ``step`` included,
      which the checkpoint keeps in the parameter groups (restored by then): the restored step is kept."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    set_original, load_original = cls._set_main_param_and_optimizer_states, cls.load_state_dict

    def set_states(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer:
            group_index, group_order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"].clone()}
        return set_original(self, model_param, tensors)

    def load_state_dict(self, state_dict):
        load_original(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    cls._set_main_param_and_optimizer_states = set_states
    cls.load_state_dict = load_state_dict


def _sequence_parallel_torch_norm() -> None:
    """Megatron's local layer spec builds torch norms, which refuse ``sequence_parallel``: their weights would not
    be marked for the all-reduce over tensor-parallel ranks that a norm seeing only its rank's share of the
    sequence needs. Build the same norm and mark its parameters, as Transformer Engine's and Apex's norms do
    (``finalize_model_grads`` then all-reduces their gradients over TP)."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, *args, **kwargs)
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def apply() -> bool:
    """Patch once when CUDA is unavailable (before NeMo builds a model); returns whether patches are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    os.environ.setdefault("NVIDIA_PYTORCH_VERSION", "24.07")  # NeMo parses it unconditionally
    from nemo_factuality.convert import cpu

    cpu.apply()
    _stub_transformer_engine()
    _stub_trt_llm()
    _patch_apex_names()
    _patch_nemo_model_building()
    # Modules that torch.jit.script functions at import must be imported before the factories are
    # wrapped: TorchScript cannot compile a call to a Python wrapper of a builtin.
    for module in _IMPORT_BEFORE_WRAPPING:
        importlib.import_module(module)
    _patch_torch_devices()
    from nemo.core.classes.modelPT import ModelPT

    ModelPT.cuda = lambda self, *a, **k: self  # NeMo's generate() moves the model with it
    _gloo_safe_all_gather()
    _patch_checkpoint_writer()
    _no_fp8_quantize_without_te()
    _torch_adam_step_on_load()
    _sequence_parallel_torch_norm()
    _APPLIED = True
    return True


# NeMo switches these fusions on by default; each needs Apex/TE/CUDA kernels.
CPU_MODEL_OVERRIDES = {
    "transformer_engine": False, "use_cpu_initialization": True, "precision": 32, "megatron_amp_O2": False,
    "sequence_parallel": False, "apply_rope_fusion": False, "bias_activation_fusion": False,
    "masked_softmax_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False,
    "bias_dropout_add_fusion": False, "cross_entropy_loss_fusion": False,
}
