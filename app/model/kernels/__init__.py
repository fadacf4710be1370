"""Device kernels (Triton) next to their plain-torch references."""
