"""`make serve`: check the config, free the ports, run `serve run`, and say when the app answers and what a stop
waits for.

The config is checked before Ray starts (deploy/check.py), and the ports by deploy/preflight.py, which also holds
a lock on the app's HTTP port for as long as this process runs, so that a second start meanwhile stops at once.
`serve run` then runs as a child, in a session of its own; once the app answers, one line gives its URL, base model,
adapters, replicas and API docs. Ctrl-C reaches this process alone. With requests in flight it waits for the
replicas to report none (up to their grace period); then, or at once with none, it ends `serve run`'s processes and
the HAProxy its cluster started. Serve's own graceful shutdown would not serve better: it stops HAProxy first,
which cuts the streams in flight, then waits (the ingress's draining period, then Ray's own shutdown). A second
Ctrl-C ends everything at once.

    python -m deploy serve serve_config.yaml
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from deploy import check, preflight
from deploy.args import GRACE_S
from deploy.state import REPLICA_DEPLOYMENT

READY_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


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


# One client for the polls: httpx.get builds a client per call, and each loads the CA bundle (~20 ms of CPU).
# No connection is kept between polls: an idle one would hold one of HAProxy's slots, and of this address's share.
_CLIENT = httpx.Client(timeout=2, limits=httpx.Limits(max_keepalive_connections=0))


def _answer(url: str, path: str, api_key: str | None) -> dict | None:
    """The app's JSON answer to GET `path`, or None where it does not answer 200."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = _CLIENT.get(f"{url}{path}", headers=headers)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def ready_line(url: str, api_key: str | None, replicas_wanted: int = 1) -> str | None:
    """The line that says the app answers with the replicas it asks for, or None until then."""
    models, replicas = _answer(url, "/v1/models", api_key), _answer(url, "/v1/debug/replicas", api_key)
    if models is None or replicas is None:
        return None
    ids = [model["id"] for model in models["data"]]
    base = next((m["id"] for m in models["data"] if m.get("parent") is None), ids[0] if ids else "?")
    count = len(replicas.get("replicas", {}))
    if count < replicas_wanted:
        return None
    return (f"ready: {url}/v1, base model {base}, {len(ids) - 1} adapters, {count} "
            f"replica{'s' if count != 1 else ''}; API docs at {url}/docs")


def in_flight(url: str, api_key: str | None) -> int | None:
    """Requests the replicas hold (Serve's calls, batch rows, the engine's queue), as they last reported (within
    about a second); None where the app does not answer."""
    replicas = _answer(url, "/v1/debug/replicas", api_key)
    if replicas is None:
        return None
    return sum(max(stats.get("ongoing", 0), stats.get("running", 0) + stats.get("waiting", 0))
               for stats in replicas.get("replicas", {}).values())


def _dies_with_parent() -> None:
    """In `serve run`, before it starts: SIGTERM when this process dies, however it dies (it does not share the
    terminal's signals). Linux only; elsewhere a `serve run` whose parent was killed keeps running."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python leaves an ignored SIGINT ignored in its children
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _end_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
    child = subprocess.Popen([str(serve_bin), "run", str(serve_config)], start_new_session=True,
                             preexec_fn=_dies_with_parent)
    host, port = http_address(serve_config)
    url, started, stop_asked_at = f"http://{host}:{port}", time.monotonic(), None
    interrupts, woken = 0, threading.Event()

    def on_signal(signum, frame):
        nonlocal interrupts, stop_asked_at
        interrupts += 1
        stop_asked_at = stop_asked_at or time.monotonic()
        woken.set()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    announced, wanted, handled, stop_by = False, expected_replicas(serve_config), 0, None
    while child.poll() is None:
        if interrupts > handled:
            handled = interrupts
            busy = in_flight(url, args.api_key) if handled == 1 else None
            if busy:
                print(f"stopping: {busy} request{'s' if busy != 1 else ''} in flight may finish first (up to "
                      f"{GRACE_S} s). Ctrl-C again to stop at once.", file=sys.stderr, flush=True)
                stop_by = time.monotonic() + GRACE_S
            else:
                print("stopping" + (": no requests in flight" if handled == 1 else " at once"), file=sys.stderr,
                      flush=True)
                _end_group(child.pid)
        elif stop_by is not None and (not in_flight(url, args.api_key) or time.monotonic() > stop_by):
            _end_group(child.pid)
        elif not announced and stop_asked_at is None and (line := ready_line(url, args.api_key, wanted)):
            print(f"{line} (started in {time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
            announced = True
        woken.wait(READY_POLL_S)
        woken.clear()
    _end_group(child.pid)  # whatever of its cluster outlived `serve run`
    if stop_asked_at is None:
        return child.returncode
    held = preflight.free_ports(ports, announce=False)  # ends the HAProxy of its cluster, which outlives it
    print(f"stopped in {time.monotonic() - stop_asked_at:.0f} s" + (
        f"; {', '.join(held)}" if held else ""), file=sys.stderr)
    return 0
