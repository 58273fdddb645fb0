"""Test support: run Megatron-Core 0.16.1 + Megatron-Bridge 0.3.1 on a CPU-only torch with gloo.

Never imported by production code. Called first thing in a test program that runs in the megatron venv
(``tools/setup_stack_env.sh megatron``), before anything imports Megatron. Each stand-in answers a failure observed on CPU
(shared/specs/maintained_stack_cpu.md, re-checked here with the backend's own tests):

* Imports. ``megatron/bridge/peft/lora_layers.py`` and ``peft/lora.py`` import ``transformer_engine.pytorch``
  unconditionally, and ``megatron/core/inference/contexts/attention_context/triton/tensor_ops.py`` (reached through
  Bridge's Mamba provider) imports ``triton``, which the CPU torch does not ship. A throw-away stub of each is visible
  only while those modules import; afterwards it is gone again and every ``HAVE_TE`` Bridge computed while the stub was
  visible is reset, so Megatron-Core picks its local (non-TE) layers as on a machine without TE. Done whenever the
  package is missing, on a GPU machine too (a bare PyTorch GPU machine has no Transformer Engine).
* CUDA call sites (only without CUDA): ``torch.cuda.current_device`` (rotary embeddings, ``core/utils.py``, the DDP grad
  buffers, Bridge's ``param_mapping.py`` broadcast, the inference controller), the CUDA RNG of
  ``core/tensor_parallel/random.py``, ``device="cuda"`` literals (``transformer/utils.py`` causal mask,
  ``optimizer/optimizer.py``, ``clip_grads.py``, the inference controller), ``Tensor.cuda()``, the
  ``t.type() == "torch.cuda.FloatTensor"`` checks of the distributed optimizer and ``clip_grads``, and
  ``torch.cuda.Event`` / streams / nvtx ranges, the ``is_cuda`` assertion before PP>1 generation's broadcasts. The
  converter's stand-ins (``convert.cpu``, the same Megatron-Core) and
  the aligner tests' device mapping (``aligner_cpu``) cover most of them; this adds events, nvtx and memory stats.

What is NOT here, because it is wrong on any device and the backend fixes it itself
(``trainers/backends/megatron/build.py``): the non-contiguous scatter of row-parallel weights, the tensor-parallel
attributes Bridge's ``perform_initialization=False`` leaves unset, the fused cross-entropy's bf16 gradient, and exported
tensors that alias live parameters.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import time
import types

import torch

_APPLIED = False


def apply() -> None:
    """Import Megatron-Bridge without Transformer Engine / triton, and (without CUDA) put the CPU stand-ins in place.
    Idempotent; call it before anything imports ``megatron``."""
    global _APPLIED
    if _APPLIED:
        return
    if not torch.cuda.is_available():
        from nemo_factuality.convert import cpu
        from nemo_factuality.testing.aligner_cpu import _patch_torch_devices

        cpu.apply()  # current_device, synchronize, CUDA RNG, Tensor.cuda, device literals in schedules/utils
        _patch_torch_devices()  # tensor factories, Tensor.to, t.type() names, Module.cuda, streams
        _patch_events_and_ranges()
        _accept_host_tensors_in_pipeline_broadcasts()
    _import_bridge_without_missing_packages()
    _APPLIED = True


def _import_bridge_without_missing_packages() -> None:
    # torch's compiler and transformers probe for triton themselves (find_spec), and Megatron-Core probes for TE
    # (try/except ImportError): all of them before any stub exists, so they see neither and pick their fallbacks
    for probing in ("torch._dynamo", "transformers", "megatron.core.extensions.transformer_engine",
                    "megatron.core.models.gpt.gpt_layer_specs"):
        importlib.import_module(probing)
    if importlib.util.find_spec("triton") is None:
        with _visible_while_importing(_triton_stub()):
            importlib.import_module("megatron.core.inference.contexts.attention_context.triton.tensor_ops")
    if importlib.util.find_spec("transformer_engine") is None:
        with _visible_while_importing(_transformer_engine_stub()):
            importlib.import_module("megatron.bridge")
        for name, module in list(sys.modules.items()):
            if name.startswith("megatron.bridge") and getattr(module, "HAVE_TE", None) is True:
                module.HAVE_TE = False
    importlib.import_module("megatron.bridge")


@contextlib.contextmanager
def _visible_while_importing(stubs: dict[str, types.ModuleType]):
    sys.modules.update(stubs)
    try:
        yield
    finally:
        for name in stubs:
            sys.modules.pop(name, None)


def _transformer_engine_stub() -> dict[str, types.ModuleType]:
    """``transformer_engine.pytorch`` with the classes Bridge's LoRA code names: ``isinstance`` against them is always
    False, so no module is ever taken for a TE layer."""
    te = types.ModuleType("transformer_engine")
    te_torch = types.ModuleType("transformer_engine.pytorch")

    class _NeverATransformerEngineModule(torch.nn.Module):
        pass

    for name in ("Linear", "LayerNormLinear", "LayerNormMLP", "TransformerLayer", "GroupedLinear", "RMSNorm",
                 "LayerNorm"):
        setattr(te_torch, name, type(name, (_NeverATransformerEngineModule,), {}))
    te_torch.ops = types.SimpleNamespace(**{
        name: type(name, (_NeverATransformerEngineModule,), {})
        for name in ("AddExtraInput", "ConstantScale", "Dropout", "LayerNorm", "Linear", "MakeExtraOutput", "Quantize",
                     "RMSNorm", "Sequential", "BasicLinear")})
    te.pytorch = te_torch
    te.__version__ = "0.0.0+stub"
    return {"transformer_engine": te, "transformer_engine.pytorch": te_torch}


def _triton_stub() -> dict[str, types.ModuleType]:
    """Enough of ``triton`` for a module of kernels to import (decorators, ``tl.constexpr`` annotations); a kernel it
    defines is never launched on CPU."""
    triton = types.ModuleType("triton")
    language = types.ModuleType("triton.language")

    def decorator(fn=None, **_kwargs):
        return fn if fn is not None else (lambda f: f)

    triton.jit = decorator
    triton.autotune = triton.heuristics = lambda *a, **k: (lambda f: f)
    triton.Config = lambda *a, **k: None
    triton.cdiv = lambda a, b: -(-a // b)
    triton.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
    language.constexpr = type("constexpr", (), {})
    triton.language = language
    return {"triton": triton, "triton.language": language}


class _HostEvent:
    """``torch.cuda.Event``: the inference controller times each generated token with them."""

    def __init__(self, *args, **kwargs) -> None:
        self.at: float | None = None

    def record(self, *args, **kwargs) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, later: _HostEvent) -> float:
        return 1000.0 * ((later.at or 0.0) - (self.at or 0.0))


def _accept_host_tensors_in_pipeline_broadcasts() -> None:
    """``inference/communication_utils.py`` asserts ``tensor.is_cuda`` before it broadcasts logits between pipeline
    stages (PP > 1 generation); gloo broadcasts host tensors."""
    from megatron.core.inference import communication_utils

    def present(tensor: torch.Tensor) -> None:
        assert tensor is not None

    communication_utils._is_cuda = present


def _patch_events_and_ranges() -> None:
    torch.cuda.Event = _HostEvent
    torch.cuda.memory_stats = lambda *a, **k: {}
    torch.cuda.nvtx.range_push = lambda *a, **k: 0
    torch.cuda.nvtx.range_pop = lambda *a, **k: 0
    torch.cuda.nvtx.mark = lambda *a, **k: None
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
