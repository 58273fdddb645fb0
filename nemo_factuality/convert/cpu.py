"""Run Megatron-Core on machines without CUDA (conversion, verification, CI).

Megatron-Core assumes CUDA in a few places (device placement, CUDA RNG tracker, ``torch.cuda.synchronize``
in checkpoint writers, ``device="cuda"`` literals in schedules/optimizers). On a CPU-only torch we
redirect those to the CPU; on a CUDA machine ``apply()`` does nothing. Facts from
shared/specs/cpu_feasibility.md §2 (observed with megatron-core 0.16.1).
"""

from __future__ import annotations

import importlib

import torch

_APPLIED = False


class _TorchShim:
    """Stands in for the module-global ``torch`` in a few Megatron modules, mapping device="cuda" to CPU."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _dev(d):
        return "cpu" if d == "cuda" or (isinstance(d, torch.device) and d.type == "cuda") else d

    def zeros(self, *a, device=None, **k):
        return torch.zeros(*a, device=self._dev(device), **k)

    def ones(self, *a, device=None, **k):
        return torch.ones(*a, device=self._dev(device), **k)

    def empty(self, *a, device=None, **k):
        return torch.empty(*a, device=self._dev(device), **k)

    def tensor(self, *a, device=None, **k):
        return torch.tensor(*a, device=self._dev(device), **k)


def apply() -> bool:
    """Patch once when CUDA is unavailable; returns whether patches are active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    import megatron.core.tensor_parallel.random as rng

    rng._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    rng._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    for module in ("megatron.core.pipeline_parallel.schedules", "megatron.core.utils"):
        importlib.import_module(module).torch = _TorchShim()
    _APPLIED = True
    return True
