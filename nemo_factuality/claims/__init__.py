"""Claim extractors (registered in ``nemo_factuality.registry.EXTRACTORS``)."""

from nemo_factuality.claims import (
    identity,  # noqa: F401  (registers "identity")
    llm,  # noqa: F401  (registers "rlfh", "factscore", "safe", "klcf")
)
