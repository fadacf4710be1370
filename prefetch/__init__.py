"""Adapter residency: host cache, device slot pool, prefetch pipeline and hint policy."""
