"""The OpenAI-compatible API: request schemas, response bodies, the fan-out of one request's choices, and what the
ingress and a replica exchange."""
