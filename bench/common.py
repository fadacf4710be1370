"""What every benchmark result records: the command, the commit, the device, then its own payload."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
REPO_DEMO = REPO / "demo"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu-{platform.machine()}-{torch.get_num_threads()}threads"


def device_slug() -> str:
    name = device_name().lower()
    for key in ("h200", "h100", "a100", "l4"):
        if key in name:
            return f"{key}-x{torch.cuda.device_count()}"
    return "cpu"


def git_commit() -> str:
    if os.environ.get("LORA_GIT_COMMIT"):  # set by device scripts: the device copy has no .git
        return os.environ["LORA_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(workload: str, payload: dict, out_dir: Path = RESULTS) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "command": " ".join(sys.orig_argv),
        "git_commit": git_commit(),
        "device": device_name(),
        "torch": torch.__version__,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **payload,
    }
    path = out_dir / f"{device_slug()}-{workload}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def timed_ms(fn, iters: int, warmup: int = 3, host: bool = False) -> list[float]:
    """Milliseconds of each of `iters` calls of fn after `warmup` calls: the GPU time between two CUDA
    events, or with host=True the host's wall time up to the GPU being done (host work included)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if host:
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def completion_stream_text(body: str) -> tuple[str, str | None]:
    """A /v1/completions SSE body's text, and the error code of an error event that ended it (else None)."""
    text = ""
    for line in body.splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return text, chunk["error"]["code"]
            text += chunk["choices"][0]["text"] if chunk["choices"] else ""
    return text, None
