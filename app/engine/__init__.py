"""The generation engine: scheduler, KV blocks, model runner, request life, and the loops that run it."""
