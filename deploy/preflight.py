"""Before `make serve` starts the app: the ports it listens on are free, or are freed from a stale HAProxy.

Ray Serve's HAProxy ingress runs HAProxy as a child of the proxy actor. When `serve run` dies without its
graceful shutdown (SIGKILL, an OOM kill, a closed terminal), the rest of the local cluster goes with it but
HAProxy is re-parented and keeps the HTTP, stats and metrics ports, answering "Internal Server Error"; the next
start then fails to bind. Ray 2.60 has no hook for this, so it is checked here, from /proc:
- a port held by an HAProxy that runs Serve's config (under RAY_SERVE_HAPROXY_CONFIG_FILE_LOC's folder) and
  has no live raylet among its ancestors is ended (SIGTERM, then SIGKILL); right after the kill the dying
  cluster may still be its ancestor, so that is waited out for a few seconds;
- a port held by anything else (a running app, another program) stops the start at once, with the process
  that holds it and how to stop it.

    python -m deploy.preflight serve_config.yaml   # exit 0 when the ports are free (after ending orphans)

`python -m deploy serve` (deploy/start.py) also holds a lock on the app's HTTP port for its life
(`hold_start_lock`), so that two starts at once cannot both pass this check: the second stops at once, naming
the first.
"""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from deploy import haproxy

SERVE_HAPROXY_CONFIG = os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", str(haproxy.config_path()))
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's state column


@dataclass(frozen=True)
class Holder:
    pid: int | None  # None: the socket's owner is not visible (another user's process)
    cmdline: str

    @property
    def is_serve_haproxy(self) -> bool:
        args = self.cmdline.split()
        return bool(args) and "haproxy" in os.path.basename(args[0]) and any(
            a.startswith(os.path.dirname(SERVE_HAPROXY_CONFIG)) for a in args)

    @property
    def is_orphaned_serve_haproxy(self) -> bool:
        return self.pid is not None and self.is_serve_haproxy and not _has_raylet_ancestor(self.pid)


def _has_raylet_ancestor(pid: int) -> bool:
    parent = _ppid(pid)
    while parent not in (None, 0, 1):
        if "raylet" in _cmdline(parent):
            return True
        parent = _ppid(parent)
    return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def holders(port: int) -> list[Holder]:
    """The processes listening on `port` on this machine."""
    inodes = _listening_inodes(port)
    if not inodes:
        return []
    found, targets = [], {f"socket:[{inode}]" for inode in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in targets for fd in (proc / "fd").iterdir()):
                found.append(Holder(int(proc.name), _cmdline(int(proc.name))))
        except OSError:  # gone, or another user's
            continue
    return found or [Holder(None, "")]


def _end(pid: int, timeout_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after timeout_s; a process that is gone already (an HAProxy that a reload or its
    own exit ended since the scan) is what was wanted."""
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists() and _ppid(pid) is not None:
            time.sleep(0.05)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def app_ports(serve_config: Path) -> list[int]:
    config = yaml.safe_load(serve_config.read_text()) or {}
    ports = [int((config.get("http_options") or {}).get("port", 8000))]
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        ports += [int(os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT", 8404)),
                  int(os.environ.get("RAY_SERVE_HAPROXY_METRICS_PORT", 9101))]
    return ports


def free_ports(ports: list[int], settle_s: float = 15.0, unseen_s: float = 3.0, announce: bool = True) -> list[str]:
    """End orphaned Serve HAProxies on `ports` (saying so, where `announce`); return one line per port something else
    still holds.

    All the ports are scanned again after each ending, and while a holder is in flux: one HAProxy holds all of
    them, so ending it on one port frees the others; a Serve HAProxy whose cluster is dying is waited for (up
    to settle_s); and a listening socket with no visible owner, which is how a socket looks while one HAProxy
    hands it to its reloaded successor, is looked at again for unseen_s before it counts as another user's."""
    start = time.monotonic()
    while True:
        found = {port: holders(port) for port in ports}
        waited = time.monotonic() - start
        orphans = {h.pid: port for port, held in found.items() for h in held if h.is_orphaned_serve_haproxy}
        for pid, port in orphans.items():
            if announce:
                print(f"ending a stale HAProxy (pid {pid}) left on :{port} by an earlier `serve run` that did not "
                      "shut down", file=sys.stderr)
            _end(pid)
        held = [h for hs in found.values() for h in hs]
        dying = any(h.pid is not None and h.is_serve_haproxy for h in held)  # its cluster is still going
        unseen = any(h.pid is None for h in held)
        if waited < settle_s and (orphans or dying or (unseen and waited < unseen_s)):
            time.sleep(0 if orphans else 0.5)
            continue
        return [f":{port} is held by a process of another user" if holder.pid is None else
                f":{port} is held by pid {holder.pid} ({holder.cmdline[:120]})"
                for port, hs in found.items() for holder in hs if not holder.is_orphaned_serve_haproxy]


def lock_path(port: int) -> Path:
    return haproxy.private_dir() / f"start-{port}.lock"


def hold_start_lock(port: int) -> int | None:
    """A lock on starting an app on `port`, held by the returned descriptor for this process's life; None when
    another start holds it (its pid is in the file)."""
    fd = os.open(lock_path(port), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def locked_message(port: int, serve_config: Path) -> str:
    holder = lock_path(port).read_text().strip() or "?"
    return (f"cannot start: another start of an app on :{port} (pid {holder}) is under way or serving. Stop it "
            f"first (Ctrl-C in its terminal), or choose another port in {serve_config} (http_options.port).")


def held_message(problems: list[str], serve_config: Path) -> str:
    return ("cannot start: " + "; ".join(problems) + ".\nIf it is a running app of this project, stop it with "
            "`RAY_AUTH_MODE=token .venv/bin/serve shutdown -y` (or end that process); otherwise choose another "
            f"port in {serve_config} (http_options.port).")


def main(argv: list[str]) -> int:
    serve_config = Path(argv[0] if argv else "serve_config.yaml")
    problems = free_ports(app_ports(serve_config))
    if problems:
        print(held_message(problems, serve_config), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
