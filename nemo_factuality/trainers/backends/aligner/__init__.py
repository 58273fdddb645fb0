"""The ``aligner`` backend (NeMo-Aligner 0.7 Megatron actors): ``actor.py`` (the actor and its builder),
``optimizer.py`` (optimizer-state offload, Adam steps in NeMo's checkpoints, resume), ``critic.py`` (the critic
server's client), ``reward.py`` (Aligner's reward client, bounded), ``spec.py`` (the layer spec) and ``memory.py``
(the presets' memory arithmetic).

Nothing is imported here, so importing this package loads neither NeMo nor Megatron: import the module you need.
"""
