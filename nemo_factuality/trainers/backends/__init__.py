"""Actor/critic backends by name: ``hf`` (transformers, CPU or one GPU), ``aligner`` (NeMo-Aligner Megatron actors) and
``megatron`` (Megatron-Core + Megatron-Bridge, HF checkpoint in and out).

Backends are imported lazily so ``import nemo_factuality.trainers`` never loads NeMo or Megatron.
"""

from __future__ import annotations

from nemo_factuality.registry import Registry

BACKENDS: Registry = Registry("training backend", lazy_modules=("nemo_factuality.trainers.backends.registered",))
