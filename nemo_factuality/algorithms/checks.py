"""Shape checks with messages that name the argument and the expected shape."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int | None]) -> None:
    """``expected`` may use ``None`` for any size; raises ``ValueError`` naming ``name``."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    ok = tensor.dim() == len(expected) and all(e is None or e == s for e, s in zip(expected, tensor.shape))
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {want}")


def check_same_shape(*named: tuple[str, torch.Tensor]) -> None:
    """All tensors must share one shape; the message lists every argument's shape."""
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    shapes = {tuple(t.shape) for _, t in named}
    if len(shapes) > 1:
        listing = " vs ".join(f"{n} {list(t.shape)}" for n, t in named)
        raise ValueError(f"shape mismatch: {listing}")
