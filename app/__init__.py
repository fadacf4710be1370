"""Model-serving logic that knows nothing of Ray: schemas, adapters, LoRA layers, engine."""
