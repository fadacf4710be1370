"""`make serve`: check the config, free the ports, run `serve run`, and say when the app answers and what a stop
waits for.

The config is checked before Ray starts (deploy/check.py), and the ports by deploy/preflight.py, which also holds
a lock on the app's HTTP port for as long as this process runs, so that a second start meanwhile stops at once.
`serve run` then runs as a child; once the app answers, one line gives its URL, base model, adapters, replicas
and API docs. Ctrl-C reaches `serve run` as well (the terminal signals the whole process group), which shuts
Serve down; this process says what that waits for and when it is done.

    python -m deploy serve serve_config.yaml
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from deploy import check, preflight
from deploy.state import REPLICA_DEPLOYMENT

READY_POLL_S = 0.5


def http_address(serve_config: Path) -> tuple[str, int]:
    options = (yaml.safe_load(serve_config.read_text()) or {}).get("http_options") or {}
    host = options.get("host", "127.0.0.1")
    return ("127.0.0.1" if host in ("0.0.0.0", "::") else host), int(options.get("port", 8000))


def expected_replicas(serve_config: Path) -> int:
    """The LoRA replicas the config asks for (at least its autoscaling minimum, or 1)."""
    for app in (yaml.safe_load(serve_config.read_text()) or {}).get("applications") or []:
        for deployment in app.get("deployments") or []:
            if deployment.get("name") == REPLICA_DEPLOYMENT:
                autoscaling = deployment.get("autoscaling_config") or {}
                count = deployment.get("num_replicas")
                return count if isinstance(count, int) else max(1, autoscaling.get("min_replicas", 1))
    return 1


def ready_line(url: str, api_key: str | None, replicas_wanted: int = 1) -> str | None:
    """The line that says the app answers with the replicas it asks for, or None until then."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        models = httpx.get(f"{url}/v1/models", headers=headers, timeout=2)
        replicas = httpx.get(f"{url}/v1/debug/replicas", headers=headers, timeout=2)
    except httpx.HTTPError:
        return None
    if models.status_code != 200 or replicas.status_code != 200:
        return None
    ids = [model["id"] for model in models.json()["data"]]
    base = next((m["id"] for m in models.json()["data"] if m.get("parent") is None), ids[0] if ids else "?")
    count = len(replicas.json().get("replicas", {}))
    if count < replicas_wanted:
        return None
    return (f"ready: {url}/v1, base model {base}, {len(ids) - 1} adapters, {count} "
            f"replica{'s' if count != 1 else ''}; API docs at {url}/docs")


def serve(serve_config: Path) -> int:
    try:
        [args, *_] = check.check_file(serve_config)
    except check.ConfigProblem as e:
        print(f"cannot start: the config has problems\n{e}", file=sys.stderr)
        return 1
    ports = preflight.app_ports(serve_config)
    if preflight.hold_start_lock(ports[0]) is None:
        print(preflight.locked_message(ports[0], serve_config), file=sys.stderr)
        return 1
    problems = preflight.free_ports(ports)
    if problems:
        print(preflight.held_message(problems, serve_config), file=sys.stderr)
        return 1
    serve_bin = Path(sys.executable).with_name("serve")
    # Ctrl-C must reach `serve run` even where this process was started with SIGINT ignored (a shell's
    # background job): Python then leaves it ignored in the child too.
    child = subprocess.Popen([str(serve_bin), "run", str(serve_config)],
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    host, port = http_address(serve_config)
    url, started, stop_asked_at = f"http://{host}:{port}", time.monotonic(), None

    def on_interrupt(signum, frame):
        nonlocal stop_asked_at
        if stop_asked_at is None:
            stop_asked_at = time.monotonic()
            print("stopping: Serve ends the replicas and HAProxy; requests in flight may finish first "
                  "(up to 30 s). Ctrl-C again to stop at once.", file=sys.stderr, flush=True)
        else:
            child.kill()

    signal.signal(signal.SIGINT, on_interrupt)
    announced, wanted = False, expected_replicas(serve_config)
    while child.poll() is None:
        if not announced and stop_asked_at is None and (line := ready_line(url, args.api_key, wanted)):
            print(f"{line} (started in {time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            announced = True
        time.sleep(READY_POLL_S)
    if stop_asked_at is None:
        return child.returncode
    exited_at = time.monotonic()
    while (held := [port for port in ports if preflight.holders(port)]) and time.monotonic() - exited_at < 40:
        time.sleep(0.5)
    print(f"stopped in {time.monotonic() - stop_asked_at:.0f} s" + (
        f"; {', '.join(f':{p}' for p in held)} still held (an HAProxy that outlived its cluster: the next start "
        "ends it)" if held else ""), file=sys.stderr)
    return 0
