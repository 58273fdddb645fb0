"""The ``megatron`` backend (Megatron-Core 0.16 + Megatron-Bridge 0.3, HF checkpoint in and out): ``actor.py`` (the
actor and its builder), ``model.py`` (model, DDP, optimizer, checkpoints shared by actor and critic), ``build.py``
(process groups, Bridge, layout), ``generate.py`` (the inference engines), ``critic.py`` (the value model) and
``memory.py`` (the presets' memory arithmetic).

Nothing is imported here, so importing this package loads neither Megatron nor vLLM: import the module you need.
"""
