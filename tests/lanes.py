"""`make test`: the whole suite as three pytest runs at once, so that it takes fewer minutes on a few cores.

Two cluster lanes hold the tests that start Ray clusters and `serve run`: one the modules that share a Ray runtime
(tests/deploy/conftest.py) and what else is in tests/deploy, the other the modules that start clusters of their own
(`ray start` nodes, `make serve`), one after another. Much of their time is spent waiting on other processes
(replicas starting, draining, health checks), and they time some of those waits. Every cluster takes free ports and
every driver names the cluster it joins (or `local`), so the two lanes' clusters never meet. The other lane,
everything else, runs beside them at the lowest CPU priority (nice 19): it takes the cores the cluster lanes leave
idle without slowing them. The first cluster lane prints as it goes; the others' reports follow it. Arguments after
the script's name go to every run. `python -m pytest` still runs the whole suite in one process.

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
OWN_CLUSTERS = ["tests/deploy/test_restart.py", "tests/deploy/test_rolling_update.py", "tests/deploy/test_two_nodes.py",
                "tests/deploy/test_slowloris.py", "tests/bench/test_serve_claim.py"]
CLUSTER_LANES = {
    "shared cluster: tests/deploy but the modules with clusters of their own": [
        "tests/deploy", *(f"--ignore={path}" for path in OWN_CLUSTERS)],
    "own clusters: " + " ".join(Path(path).stem for path in OWN_CLUSTERS): OWN_CLUSTERS,
}
OTHER_LANE = ["tests", "--ignore=tests/deploy",
              *(f"--ignore={path}" for path in OWN_CLUSTERS if not path.startswith("tests/deploy/"))]


def pytest(paths: list[str], args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *paths, *args]


def main(args: list[str]) -> int:
    started = time.monotonic()
    (first_name, first_paths), *rest = CLUSTER_LANES.items()
    lanes = [*rest, ("the other lane: tests/ but the cluster lanes", OTHER_LANE)]
    reports = [tempfile.TemporaryFile("w+") for _ in lanes]
    running = [subprocess.Popen(pytest(paths, args), cwd=REPO_ROOT, stdout=report, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.nice(19)) if paths is OTHER_LANE else None)
               for (_, paths), report in zip(lanes, reports)]
    try:
        print(f"== {first_name} (the other lanes run beside it)", flush=True)
        codes = [subprocess.run(pytest(first_paths, args), cwd=REPO_ROOT).returncode]
        first_s = time.monotonic() - started
        codes += [process.wait() for process in running]
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
    for (name, _), report in zip(lanes, reports):
        report.seek(0)
        print(f"\n== {name}\n{report.read()}", flush=True)
        report.close()
    print(f"== exit codes {codes} ({first_name.split(':')[0]} lane after {first_s:.0f} s, then the others); "
          f"{time.monotonic() - started:.0f} s in all")
    return next((code for code in codes if code), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
