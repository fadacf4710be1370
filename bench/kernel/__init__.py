"""Kernel benchmarks: the Triton decode attention and segmented LoRA kernels against the HBM read floor
measured in the same run (CUDA), and the structured-output grammar libraries (host CPU)."""
