"""A stand-in for NVIDIA Apex as the NGC container has it: importable, so Megatron-Core picks its Apex norm
(``FusedLayerNorm``, which refuses RMSNorm) wherever nothing says otherwise. It holds no kernels: Megatron's
own guarded imports of Apex's submodules fail, as they do where Apex was built without its extensions."""
