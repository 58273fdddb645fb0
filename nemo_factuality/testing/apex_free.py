"""Test support: run NeMo 2.2 + NeMo-Aligner 0.7.0 + megatron-core 0.12 without Apex, Transformer Engine and
TensorRT-LLM, on a GPU or (with ``aligner_cpu``) on CPU.

Never imported by production code. The GPU smoke kit (``tools/gpu_smoke.sh``) calls ``apply()`` on a bare GPU
machine where only these Python packages could be carried; ``aligner_cpu.apply()`` calls it under its CPU
device layer. Each patch is a failure observed without those CUDA-built packages:

* Transformer Engine: a stub so Megatron decides it is absent (the spec itself is production's choice,
  ``trainers/backends/aligner/spec.py``); the local spec's torch norms refuse ``sequence_parallel`` — built and marked for the TP all-reduce
  as TE's norms are; megatron-core 0.12's distributed optimizer "quantizes" fp8 parameters after every step and
  raises without TE even when there are none.
* Apex: names NeMo imports (``FusedLayerNorm``, ``MixedFusedRMSNorm``, ``listify_model``, ``amp_C`` kernels
  as plain torch); NeMo's strategy refuses to start without Apex although nothing here calls it; NeMo's wrapper
  of Megatron-Core's distributed optimizer (no Apex needed) is imported only together with Apex's.
* torch's AdamW, megatron-core 0.12's fallback optimizer without Apex/TE, loses its per-parameter ``step`` on a
  distributed-optimizer checkpoint load (KeyError, and a step tensor shared by every parameter), and a fresh
  one (a resumed run before its first step) cannot describe its state for the load at all.
* ``nemo_aligner.utils.trt_llm`` imports tensorrt_llm → tensorrt → mpi4py (stubbing those breaks Lightning's MPI
  detection): the module is replaced by one whose ``GPTGenerateTRTLLM`` raises.
* megatron-core 0.12's async checkpoint writer against torch ≥ 2.7's ``_write_item`` signature, and its
  checkpoint validation's ``np.product`` against numpy 2.
* NeMo's import-time extras that the aligner path never calls (``stub_absent_modules``, the smoke kit's).
"""

from __future__ import annotations

import functools
import os
import sys
import types

import torch

_APPLIED = False


def _stub_transformer_engine() -> None:
    """Megatron decides HAVE_TE when these import; NeMo's spec files then import TE names it never builds."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.transformer  # noqa: F401

    class _NoTransformerEngine:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("Transformer Engine is not installed")

    def te_name(name: str):
        # dunders stay absent: ``inspect`` (torch.library, at torchvision's import) reads a module's ``__file__``
        if name.startswith("__"):
            raise AttributeError(name)
        return _NoTransformerEngine

    stub = types.ModuleType("megatron.core.extensions.transformer_engine")
    stub.__getattr__ = te_name
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
    # (the layer spec is production's: trainers/backends/aligner/spec.py builds the one the config asks for)


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
    load mishandles that AdamW's per-parameter ``step`` (a resumed run would fail, or step differently):

    * ``load_state_dict`` gives every parameter's state the *same* step tensor, which torch's AdamW then
      increments once per parameter on the next step (Adam's bias correction goes wrong): each gets its own copy;
    * the fully-sharded load copies every per-parameter state tensor from the checkpoint, ``step`` included,
      which the checkpoint keeps in the parameter groups (restored by then): the restored step is kept;
    * a fresh optimizer (a new process resuming) has no state yet to describe for the load: it gets AdamW's
      initial state (zero moments, step 0), which the load then overwrites."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        return
    cls = distrib_optimizer.DistributedOptimizer
    set_original, load_original, state_dict_original = (cls._set_main_param_and_optimizer_states, cls.load_state_dict,
                                                        cls.state_dict)

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

    def state_dict(self):
        # a fresh optimizer (a resumed run, before its first step) has no per-parameter state, and the step
        # extraction asserts one: give it the state torch's AdamW starts from (zero moments, step 0)
        if not self.optimizer.state and not self.config.use_precision_aware_optimizer:
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    self.optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                                   "exp_avg_sq": torch.zeros_like(param)}
        return state_dict_original(self)

    cls._set_main_param_and_optimizer_states = set_states
    cls.load_state_dict = load_state_dict
    cls.state_dict = state_dict


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


# Packages NeMo 2.2 / megatron-core 0.12 import at load, unguarded, on the aligner path but never call there
# (Chinese tokenizers, downloads, web/zarr dataset formats, ROUGE): where they are absent (the GPU smoke kit
# carries only what the actor runs) they become stubs whose every name raises when used. Found by running the
# kit on CPU in a venv holding only the GPU machine's packages plus the carried ones; imports NeMo guards itself
# (nvidia-modelopt, boto3, faiss) are left missing, so NeMo takes its own fallback.
ABSENT_OK = ("wget", "braceexpand", "webdataset", "ijson", "rouge_score", "jieba", "opencc", "zarr")


class _AbsentName:
    """What a stubbed module gives for any name: usable as a base class or annotation, raising when called."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(f"{type(self).__module__}.{type(self).__qualname__} belongs to a package this machine "
                           "lacks (stubbed by nemo_factuality.testing.apex_free: the aligner path never uses it)")


class _StubModule(types.ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package: submodules are stubs too

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        stub = type(attr, (_AbsentName,), {"__module__": self.__name__})
        setattr(self, attr, stub)
        return stub


class _AbsentModuleFinder:
    """Last on ``sys.meta_path``: only imports no real finder resolved reach it, and only ``roots`` are stubbed."""

    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = set(roots)
        self.stubbed: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        import importlib.util

        if name.split(".")[0] not in self.roots:
            return None
        self.stubbed.add(name.split(".")[0])
        return importlib.util.spec_from_loader(name, self, is_package=True)

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        return None


def stub_absent_modules(roots: tuple[str, ...] = ABSENT_OK) -> _AbsentModuleFinder:
    """Stub the listed packages where they are not installed (installed ones are imported as usual)."""
    finder = next((f for f in sys.meta_path if isinstance(f, _AbsentModuleFinder)), None)
    if finder is None:
        finder = _AbsentModuleFinder(roots)
        sys.meta_path.append(finder)
    return finder


def _numpy2_aliases() -> None:
    """megatron-core 0.12's checkpoint validation calls ``np.product``, an alias of ``np.prod`` that numpy 2 removed
    (a bare GPU machine has numpy 2; the stack's own venv pins numpy < 2)."""
    import numpy as np

    if not hasattr(np, "product"):
        np.product = np.prod


def apply() -> bool:
    """Patch once (before NeMo builds a model); returns True. Safe where Apex/TE exist: each patch checks first."""
    global _APPLIED
    if _APPLIED:
        return True
    os.environ.setdefault("NVIDIA_PYTORCH_VERSION", "24.07")  # NeMo parses it unconditionally
    _stub_transformer_engine()
    _stub_trt_llm()
    _patch_apex_names()
    _patch_nemo_model_building()
    _patch_checkpoint_writer()
    _no_fp8_quantize_without_te()
    _torch_adam_step_on_load()
    _sequence_parallel_torch_norm()
    _numpy2_aliases()
    _APPLIED = True
    return True
