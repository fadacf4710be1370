"""PEFT LoRA adapters: the file format and its checks, the registry, and the modules an adapter may target."""
