"""Engine benchmarks, in process and without Ray: the decode step and prefill against the hardware floor,
mixed and whole-step profiles, offline throughput, adapter capacity, and router hints against plain LRU at
equal adapter memory (hints.py, with its arms, driver and plots)."""
