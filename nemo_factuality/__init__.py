"""nemo_factuality: factuality post-training toolkit for the NeMo / Megatron-Core stack.

``import nemo_factuality`` stays light: heavy stacks (PyTriton, Megatron-Core, NeMo, vLLM)
are imported only inside the subpackages that need them.
"""

import logging

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())
