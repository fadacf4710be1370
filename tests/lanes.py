"""`make test`: the whole suite as two pytest runs at once, so that it takes fewer minutes on a few cores.

The cluster lane holds the tests that start Ray clusters and `serve run`. Much of their time is spent waiting on
other processes (replicas starting, draining, health checks), and they time some of those waits. The other lane,
everything else, runs beside it at the lowest CPU priority (nice 19): it takes the cores the cluster lane leaves
idle without slowing it. The cluster lane prints as it goes; the other lane's report follows it. Arguments after
the script's name go to both runs. `python -m pytest` still runs the whole suite in one process.

    python tests/lanes.py -q -rs --durations=15
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Every module that starts a Ray cluster or `serve run` (tests/deploy/conftest.py runs the ones that share a Ray
# runtime one after another).
CLUSTER_LANE = ["tests/deploy", "tests/bench/test_serve_claim.py"]
# Ray runs its workers (replicas, controllers) at nice 15, next to the other lane's 19 the scheduler weighs them 36
# against 15: replicas would share the cores with the other lane instead of taking them first. The cluster lane's
# clusters run their workers at nice 0.
CLUSTER_ENV = {"RAY_worker_niceness": "0"}


def other_lane() -> list[str]:
    return ["tests", *(f"--ignore={path}" for path in CLUSTER_LANE)]


def pytest(paths: list[str], args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *paths, *args]


def main(args: list[str]) -> int:
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as report:
        others = subprocess.Popen(pytest(other_lane(), args), cwd=REPO_ROOT, stdout=report,
                                  stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(19))
        try:
            print(f"== cluster lane: {' '.join(CLUSTER_LANE)} (the other lane runs beside it)", flush=True)
            cluster = subprocess.run(pytest(CLUSTER_LANE, args), cwd=REPO_ROOT,
                                     env={**os.environ, **CLUSTER_ENV}).returncode
            cluster_s = time.monotonic() - started
            others_code = others.wait()
        finally:
            if others.poll() is None:
                others.kill()
        report.seek(0)
        print(f"\n== the other lane: tests/ but the cluster lane\n{report.read()}", flush=True)
    total_s = time.monotonic() - started
    print(f"== cluster lane exit {cluster} after {cluster_s:.0f} s; other lane exit {others_code}; "
          f"{total_s:.0f} s in all")
    return cluster or others_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
