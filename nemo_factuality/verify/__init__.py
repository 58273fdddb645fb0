"""Verifiers (registered in ``nemo_factuality.registry.VERIFIERS``)."""

from nemo_factuality.verify import (
    kb,  # noqa: F401  (registers "kb_exact")
    llm_judge,  # noqa: F401  (registers "llm_judge")
    nli,  # noqa: F401  (registers "nli")
)
