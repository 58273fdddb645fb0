"""Verifiers (registered in ``nemo_factuality.registry.VERIFIERS``)."""

from nemo_factuality.verify import kb  # noqa: F401  (registers "kb_exact")
from nemo_factuality.verify import llm_judge  # noqa: F401  (registers "llm_judge")
from nemo_factuality.verify import nli  # noqa: F401  (registers "nli")
