"""Helper threads beside the engine (adapter reads, downloads, slot copies, validations) run torch's CPU ops on one
thread.

torch runs a CPU op over a large tensor (a copy, a zero fill) on an OpenMP team of torch.get_num_threads() threads, and
a thread that runs such an op gets a team of its own, whose threads outlive the op. When more threads belong to teams
than the machine has cores, GNU OpenMP (torch's on Linux) lets idle team threads sleep at once instead of spinning a
while, and each small parallel op of the engine then waits for its team to wake: with the helpers on torch's thread
count, the CPU engine served 60.7 output tok/s where it serves 143.8 (2 cores, docs/architecture.md has the command). A
helper's ops (copies, finiteness checks) run beside the engine's work, and one thread does them.

torch has no per-thread team size (torch.set_num_threads also sets the size that every thread started later begins
with, the engine's included); OpenMP's own omp_set_num_threads, which threadpoolctl calls, sets the calling thread's.
"""

from __future__ import annotations

import torch
from threadpoolctl import threadpool_limits


def one_cpu_thread() -> None:
    """Make this thread's torch CPU ops run on one thread: a ThreadPoolExecutor initializer for helper threads."""
    torch.get_num_threads()  # torch sizes a thread's team at its first parallel op; size it now, then override
    threadpool_limits(1, user_api="openmp")
