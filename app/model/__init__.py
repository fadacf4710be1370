"""The model's layers the engine swaps in: paged attention, multi-adapter LoRA, fused norms, and their kernels."""
