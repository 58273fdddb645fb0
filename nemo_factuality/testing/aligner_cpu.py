"""Test support: run NeMo 2.2 + NeMo-Aligner 0.7.0 actors on a CPU-only torch with gloo.

Never imported by production code. Called first thing in a test program that runs in the Aligner venv
(``tools/setup_stack_env.sh aligner``), before NeMo builds a model. On a machine with CUDA it does nothing.

What it replaces, each a failure observed on CPU (shared/specs/aligner_actor_cpu.md), on top of
``apex_free.apply()`` (no Apex, Transformer Engine or TensorRT-LLM, which a bare GPU shares):

* Megatron-Core's CUDA RNG/device calls: ``nemo_factuality.convert.cpu.apply()`` (the converter's shims).
* ``device="cuda"`` literals and ``torch.cuda.*Tensor`` constructors across Megatron, NeMo and Aligner
  (causal masks, ``clip_grads``, ``Timer``, text generation): tensor factories and ``Tensor.to`` map a
  CUDA device to the CPU; ``Module.cuda()`` (``ModelPT.cuda`` in ``generate``) is the identity;
  ``torch.cuda.Stream`` is inert; ``t.type()`` names a CPU tensor as its CUDA twin (the optimizers that keep
  fp32 main weights accept only CUDA type names).
* ``pin_memory=True`` host copies (the critic's CPU weight copy) need an accelerator: made unpinned.
* gloo: ``all_gather`` / ``all_gather_into_tensor`` of 0-dim tensors (NCCL accepts them, gloo does not), e.g.
  ``rebalance_nd_tensor`` in ``ReinforceTrainer`` and the critic server's inference.
"""

from __future__ import annotations

import functools
import importlib

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


def apply() -> bool:
    """Patch once when CUDA is unavailable (before NeMo builds a model); returns whether patches are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    from nemo_factuality.convert import cpu
    from nemo_factuality.testing import apex_free

    cpu.apply()
    apex_free.apply()
    # Modules that torch.jit.script functions at import must be imported before the factories are
    # wrapped: TorchScript cannot compile a call to a Python wrapper of a builtin.
    for module in _IMPORT_BEFORE_WRAPPING:
        importlib.import_module(module)
    _patch_torch_devices()
    from nemo.core.classes.modelPT import ModelPT

    ModelPT.cuda = lambda self, *a, **k: self  # NeMo's generate() moves the model with it
    _gloo_safe_all_gather()
    _APPLIED = True
    return True


# NeMo switches these fusions on by default; each needs Apex/TE/CUDA kernels.
CPU_MODEL_OVERRIDES = {
    "transformer_engine": False, "use_cpu_initialization": True, "precision": 32, "megatron_amp_O2": False,
    "sequence_parallel": False, "apply_rope_fusion": False, "bias_activation_fusion": False,
    "masked_softmax_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False,
    "bias_dropout_add_fusion": False, "cross_entropy_loss_fusion": False,
}
