"""Test support: Transformer Engine's ``FusedAdam`` as Megatron-Core 0.16.1 sees it, on a CPU.

In the ``megatron`` container TE is installed, so Megatron-Core builds TE's ``FusedAdam`` (``optimizer/__init__.py``)
and its distributed optimizer takes its TE branches (``distrib_optimizer.USING_TE_OPTIMIZER``): Adam's step lives in
each parameter group, not in each parameter's state, and this backend's torch-AdamW workarounds
(``backends/megatron/build.py``: ``initialize_adam_state``, ``load_optimizer_state``) are bypassed. The CPU tests run
without TE, so without this stand-in that path would never run before a GPU cluster does.

``FusedAdam`` keeps TE's interface and state layout — constructor arguments (``adam_w_mode``: decoupled weight decay),
``group["step"]`` counted per non-empty group, ``exp_avg`` / ``exp_avg_sq`` per parameter — and TE's arithmetic
(``p -= lr · (m̂ / (√v̂ + ε) + wd · p)`` in AdamW mode, the update of NVIDIA's ``multi_tensor_adam`` kernel), in plain
torch. ``install()`` makes Megatron-Core build it and take the TE branches; call it after ``megatron_cpu.apply()`` and
before the model's optimizer is built. Never imported by production code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW with TE ``FusedAdam``'s state layout (module docstring); fp32 states, no master weights of its own."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, **unsupported: Any) -> None:
        if amsgrad or unsupported:  # what Megatron passes only with the precision-aware optimizer, never built here
            raise ValueError(f"the FusedAdam stand-in has no amsgrad or {sorted(unsupported)}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                                      weight_decay=weight_decay))
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            if not group["params"]:
                continue  # TE does not count a step for an empty group
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            step = group["step"]
            c1, c2 = (1 - beta1**step, 1 - beta2**step) if group["bias_correction"] else (1.0, 1.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                grad = p.grad if self.adam_w_mode else p.grad + group["weight_decay"] * p
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (state["exp_avg"] / c1) / ((state["exp_avg_sq"] / c2).sqrt() + group["eps"])
                if self.adam_w_mode:
                    update = update + group["weight_decay"] * p
                p.add_(update, alpha=-group["lr"])
        return loss


def install() -> None:
    """Megatron-Core builds ``FusedAdam`` for ``optimizer="adam"`` and its distributed optimizer takes the TE branches
    (as with TE installed)."""
    import megatron.core.optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    megatron_optimizer.Adam = distrib_optimizer.Adam = FusedAdam  # the latter: the distributed optimizer's type check
    megatron_optimizer.USING_PYTORCH_OPTIMIZER = False
    distrib_optimizer.HAVE_APEX_OR_TE = True
    distrib_optimizer.USING_TE_OPTIMIZER = True
