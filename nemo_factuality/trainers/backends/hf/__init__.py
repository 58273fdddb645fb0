"""The ``hf`` backend (transformers; CPU or one GPU): ``actor.py`` holds ``HFActor`` (the ``PolicyActor``) and
``HFCritic`` (the ``Critic``), and the sampled distribution and log-prob helpers the megatron backend shares.

Nothing is imported here: import the module you need (``backends.hf.actor``).
"""
