"""Token choice: sampling parameters, the batched sampler, logits processors, logprobs and structured output."""
