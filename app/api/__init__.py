"""The OpenAI-compatible API: request schemas, response bodies, and the fan-out of one request's choices."""
