"""The serve bench's host CPU window: a process that spins for a known CPU time shows as its CPU seconds and as
busy cores on the host."""

from __future__ import annotations

import subprocess
import sys

from bench.serve.host_cpu import CpuWindow

SPIN = ("import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\n"
        "print('spun', flush=True)\ninput()")


def test_a_spinning_process_counts_as_its_cpu_time_and_busy_cores():
    spin = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        window = CpuWindow([spin.pid, 2 ** 22 + 1])  # a pid that does not run is skipped
        assert spin.stdout.readline() == "spun\n"
        cpu = window.read()
    finally:
        spin.communicate("\n", timeout=30)
    # 0.6 s of spinning, less the part of the interpreter's start that came before the window
    assert 0.5 <= cpu["processes_cpu_s"] <= 1.0 and cpu["processes"] == 2
    assert 0.5 / cpu["seconds"] <= cpu["busy_cores_mean"] <= cpu["cores"]
