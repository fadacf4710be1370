"""The architectures the engine serves (architectures.py) and the layers it swaps into their models: paged
attention, multi-adapter LoRA, fused norms, logit soft-capping, and their kernels."""
