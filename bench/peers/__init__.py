"""Other engines on our benchmarks' workloads, for side-by-side figures: vllm.py runs the offline throughput workload
through vLLM, and compare.py sets its results beside ours. vLLM is an optional dependency of these benchmarks alone,
never installed with the project; only this package imports it.
"""
