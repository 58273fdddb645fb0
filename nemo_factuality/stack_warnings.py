"""The warnings Megatron-Core, NeMo and torch.distributed give on every run about what this project does on purpose,
silenced where those stacks are imported and run (``convert verify``'s ranks, the GPU smoke kit's phases).

Each is named by its message and category (or, for a line transformers logs instead of warning, its logger), with
why it is expected, so any other warning of theirs still shows: a run of ``convert verify`` or of the smoke kit's
megatron phase printed about fifteen of these ahead of its result. Nothing here is a blanket ``ignore``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

#: (category, the message's start as a regex, why it is expected here)
EXPECTED: tuple[tuple[type[Warning], str, str], ...] = (
    (UserWarning, r"(Transformer Engine and )?Apex (is|are) not installed",
     "the local layer spec, torch norms and torch optimizers are the CPU path's choice, not a fallback"),
    (UserWarning, r"full scope is deprecated", "Megatron-Core 0.16's own TransformerConfig default (cuda_graph_scope)"),
    (UserWarning, r"The legacy GroupedMLP will be deprecated", "Megatron-Core's TE spec module, at import; no MoE here"),
    (UserWarning, r"The static engine will be deprecated",
     "the smoke kit measures the static engine against the dynamic one on purpose"),
    (FutureWarning, r"`load_state_dict` is deprecated", "Megatron-Core's dist_checkpointing calls torch's old name"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     "torch.distributed.checkpoint reading Megatron-Core's ShardedTensor checkpoints"),
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated",
     "torch 2.13's renamed collectives (all_gather_into_tensor, …), which Megatron-Core 0.16's TP layers still call"),
    (UserWarning, r"When using async grad allreduce it is recommended to set the environment variable "
                  r"CUDA_DEVICE_MAX_CONNECTIONS", "a GPU speed hint of Megatron-Core's TP layers; on CPU it means nothing"),
)


#: The same kind of line logged rather than warned: (logger, the message's start, why it is expected here)
EXPECTED_LOGS: tuple[tuple[str, str, str], ...] = tuple(
    (logger, "`torch_dtype` is deprecated", "Megatron-Bridge 0.3.1 loads and reads HF models with `torch_dtype`, "
     "which transformers 4.57 renamed `dtype`") for logger in ("transformers.modeling_utils",
                                                               "transformers.configuration_utils"))


class _Expected(logging.Filter):
    """Drops the records of one logger whose message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def ignore_expected_warnings() -> list[tuple[logging.Logger, logging.Filter]]:
    """Install the ``EXPECTED`` and ``EXPECTED_LOGS`` filters in this process (one that runs the stack: a smoke phase,
    a verify rank); returns the log filters installed."""
    for category, message, _why in EXPECTED:
        warnings.filterwarnings("ignore", message=message, category=category)
    installed = [(logging.getLogger(name), _Expected(start)) for name, start, _why in EXPECTED_LOGS]
    for logger, quiet in installed:
        logger.addFilter(quiet)
    return installed


@contextmanager
def expected_warnings_ignored() -> Iterator[None]:
    """``ignore_expected_warnings`` for the block only."""
    with warnings.catch_warnings():
        installed = ignore_expected_warnings()
        try:
            yield
        finally:
            for logger, quiet in installed:
                logger.removeFilter(quiet)
