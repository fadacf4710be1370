"""The host's CPU over one run, read from /proc (Linux): how many cores were busy on average, and how much CPU time
given processes (the emulated store's) took, so that a run can tell work the benchmark's own stand-ins put on the
host from the serving system's.

    window = CpuWindow(store.pids())
    ...  # the run
    window.read()  # {"seconds": 41.2, "cores": 16, "busy_cores_mean": 6.3, "processes_cpu_s": 88.1, ...}
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _host_ticks() -> tuple[int, int]:
    """(busy, total) jiffies over every core since boot: /proc/stat's first line, idle and iowait not busy."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _process_cpu_s(pids: Sequence[int]) -> float:
    """User and system CPU seconds of the processes still running (utime and stime, /proc/<pid>/stat)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()  # the command name may hold spaces
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total / _TICKS_PER_S


class CpuWindow:
    """The host's busy cores and `pids`' CPU time from construction to `read()`."""

    def __init__(self, pids: Sequence[int] = ()):
        self.pids = list(pids)
        self._started = time.perf_counter()
        self._ticks = _host_ticks()
        self._processes_s = _process_cpu_s(self.pids)

    def read(self) -> dict:
        busy, total = _host_ticks()
        busy, total = busy - self._ticks[0], total - self._ticks[1]
        cores = os.cpu_count() or 1
        return {"seconds": time.perf_counter() - self._started, "cores": cores,
                "busy_cores_mean": cores * busy / max(total, 1),
                "processes": len(self.pids), "processes_cpu_s": _process_cpu_s(self.pids) - self._processes_s}
