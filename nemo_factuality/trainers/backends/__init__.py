"""Actor/critic backends by name: ``hf`` (transformers, CPU or one GPU) and ``aligner`` (NeMo-Aligner Megatron actors).

Backends are imported lazily so ``import nemo_factuality.trainers`` never loads NeMo or Megatron.
"""

from __future__ import annotations

from nemo_factuality.registry import Registry

BACKENDS: Registry = Registry("training backend", lazy_modules=("nemo_factuality.trainers.backends.registered",))
