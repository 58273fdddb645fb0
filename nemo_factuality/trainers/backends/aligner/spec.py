"""The layer spec a NeMo 2.2 / NeMo-Aligner 0.7 model is built with: the one its checkpoint and machine call for.

NeMo's ``get_specs`` gets three things wrong for the models this toolkit trains (Qwen2.5 / R1-distill: RMSNorm):

* its local spec (``transformer_engine: false``) is Megatron-Core's ``get_gpt_layer_local_spec`` called without
  ``normalization``; where Apex imports (every NGC container) Megatron then builds ``FusedLayerNorm``, which
  asserts ``normalization == "LayerNorm"`` — every RMSNorm model fails to build, and the block's final norm
  (``transformer_block.LayerNormImpl``, chosen the same way) fails even when the layers are right;
* it builds every spec it knows eagerly (TE, Falcon, Gemma 2, ModelOpt, Hyena) to return one, so a machine
  without Transformer Engine cannot build even the local spec;
* NeMo-Aligner's reward and critic models call it without ``use_te``, i.e. always with the TE spec, whatever
  the config's ``transformer_engine`` says.

``use_checkpoint_layer_specs(transformer_engine)`` replaces it in both modules before a model is built
(``nemo_trainer`` calls it for the actor and the critic server): ``transformer_engine: true`` (the presets, on the
container) builds Megatron-Core's TE spec, whose norms read ``normalization`` from the config; ``false`` (CPU,
a bare GPU) builds the local spec with the config's normalization for every layer norm and the final norm.
Spec names other than the default go to NeMo's own function.
"""

from __future__ import annotations

import functools
from typing import Any

_ORIGINAL = "_nemo_factuality_original_get_specs"


def layer_spec(spec_name: str, transformer_config: Any = None, use_te: bool = True, *args: Any, original=None,
               **kwargs: Any):
    """The default GPT spec (``spec_name == ""``) for ``transformer_config``: TE's with ``use_te``, else the local
    spec as a whole block (layers and final norm) built with the config's ``normalization``."""
    if spec_name not in ("", "te_gpt"):
        return original(spec_name, transformer_config, use_te, *args, **kwargs)
    from megatron.core.models.gpt import gpt_layer_specs

    experts = getattr(transformer_config, "num_moe_experts", None)
    grouped = bool(getattr(transformer_config, "moe_grouped_gemm", False))
    if use_te or spec_name == "te_gpt":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(experts, grouped)
    normalization = getattr(transformer_config, "normalization", "LayerNorm")
    layer = gpt_layer_specs.get_gpt_layer_local_spec(experts, grouped, normalization=normalization)
    if transformer_config is None:
        return layer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    # the final norm as the layers' norm: Megatron would take its module-level LayerNormImpl (Apex's when importable)
    norm = layer.submodules.input_layernorm
    block = TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(transformer_config), layer_norm=norm)
    return ModuleSpec(module=TransformerBlock, submodules=block)


def use_checkpoint_layer_specs(transformer_engine: bool) -> None:
    """Install ``layer_spec`` as ``get_specs`` in NeMo's GPT model module (the actor passes its own ``use_te``) and
    in NeMo-Aligner's reward/critic module (which passes none: it gets ``transformer_engine``). Idempotent."""
    import importlib.util

    if transformer_engine and importlib.util.find_spec("transformer_engine") is None:
        from nemo_factuality.types import FactualityInputError

        raise FactualityInputError("transformer_engine=true (the presets' setting, for the container) but Transformer "
                                   "Engine is not installed here: run in the trainer container, or build Megatron-Core's local layer "
                                   "spec: transformer_engine: false in the preset's aligner block (the actor), "
                                   "critic.model_overrides.transformer_engine=false (the critic server)")
    import nemo.collections.nlp.models.language_modeling.megatron_gpt_model as gpt_module
    import nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model as reward_module

    original = getattr(gpt_module, _ORIGINAL, None) or gpt_module.get_specs
    setattr(gpt_module, _ORIGINAL, original)
    gpt_module.get_specs = functools.partial(layer_spec, original=original)

    def reward_spec(spec_name: str, transformer_config: Any = None, *args: Any, **kwargs: Any):
        kwargs.pop("use_te", None)
        return layer_spec(spec_name, transformer_config, bool(transformer_engine), original=original)

    reward_module.get_specs = reward_spec
