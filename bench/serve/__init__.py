"""Benchmarks through Ray Serve and HTTP: load (output tokens/s, TTFT, chunk gaps), the hints claim with one
fresh deployment per arm, Serve's overhead on TTFT, a smoke check and the soak."""
