"""HF ↔ NeMo (.nemo with Megatron-Core torch_dist weights) converters; the only Megatron importer outside trainers."""
