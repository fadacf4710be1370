"""The emulated store's proxy (bench/serve/store.py): each request goes to a moto shard that holds its object, and
each response waits a first-byte delay and passes a per-connection bandwidth cap.

    python -m bench.serve.store_proxy --port 9100 --upstream-ports 9000 9001 --latency-ms 100 --mbps 150 \
        --sources sources.json

An adapter's weights are an alias (`--sources`: a JSON object from each weights key to the key of the object
holding its bytes, which every shard holds): each ranged GET of them goes to the shard its name and range start
hash to, so that the ranges of one object come from several processes at once, as a real store serves each range
at a connection's rate. Every other object is read from shard 0. Several proxy processes share one port
(SO_REUSEPORT), so that pacing the bytes is spread over processes too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
import zlib
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

CHUNK = 256 * 1024  # bytes the proxy moves at once; also the token bucket's burst
WEIGHTS_NAME = "adapter_model.safetensors"  # PEFT's weights file (as app/adapters/safetensors_file.py names it, without
# importing torch into the proxies): the one object of an adapter that is an alias of a shared source
_RANGE_START = re.compile(rb"\r\nrange:\s*bytes=(\d+)-", re.IGNORECASE)


def route(request_head: bytes, sources: dict[str, str], shards: int) -> tuple[int, bytes]:
    """Where a request goes, from its head (`GET /bucket/key?query HTTP/1.1\r\n...`): the shard, and the head to
    send it, whose path names the source of an aliased key. An aliased key's request goes to the shard that its key
    and its range's first byte hash to (the first byte is 0 without a Range header); every other request, a listing
    or a head that does not parse included, goes to shard 0 unchanged."""
    line, sep, rest = request_head.partition(b"\r\n")
    parts = line.split(b" ")
    if len(parts) < 3:
        return 0, request_head
    target = urlsplit(parts[1].decode("latin-1"))
    key = unquote(target.path).lstrip("/")
    source = sources.get(key)
    if source is None:
        return 0, request_head
    start = _RANGE_START.search(sep + rest)
    shard = zlib.crc32(f"{key}@{int(start.group(1)) if start else 0}".encode()) % shards
    path = "/" + quote(source) + (f"?{target.query}" if target.query else "")
    return shard, b" ".join([parts[0], path.encode("latin-1"), *parts[2:]]) + sep + rest


# Written by hand: no maintained Python library emulates a slow link (toxiproxy, which does, is a Go binary that
# the package registries do not carry).

class TokenBucket:
    """At most `rate` bytes/s on average, in bursts of at most `burst` bytes; a take beyond the tokens waits."""

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.monotonic()

    async def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        if self.tokens < 0:  # the debt is repaid while sleeping; the next take refills from `stamp`
            await asyncio.sleep(-self.tokens / self.rate)


async def _relay(client_reader, client_writer, upstreams: list[tuple[str, int]], sources: dict[str, str],
                 latency_s: float, rate: float) -> None:
    """One client connection: each request goes to a shard that holds its object (`route`), over one upstream
    connection per shard, opened when first needed; each response's first bytes wait until `latency_s` after its
    request's first bytes, and every response byte passes one token bucket. HTTP/1.1 sends a connection's requests
    one after another, so 'the client wrote while no request awaited its response' marks a new request (reads
    carry no body that could overlap their response), and at most one upstream answers at a time."""
    loop, bucket = asyncio.get_running_loop(), TokenBucket(rate, CHUNK)
    sent_at: list[float] = []  # the awaiting request's first-byte time, if one awaits its response
    writers: dict[int, asyncio.StreamWriter] = {}
    ended = asyncio.Event()
    tasks: list[asyncio.Task] = []

    def until_ended(coroutine) -> None:
        async def run():
            try:
                await coroutine
            except (ConnectionError, OSError):
                pass
            finally:
                ended.set()

        tasks.append(asyncio.create_task(run()))

    async def responses(up_reader):
        while data := await up_reader.read(CHUNK):
            if sent_at:
                await asyncio.sleep(sent_at.pop() + latency_s - loop.time())
            await bucket.take(len(data))
            client_writer.write(data)
            await client_writer.drain()

    async def upstream(shard: int) -> asyncio.StreamWriter:
        if shard not in writers:
            up_reader, writers[shard] = await asyncio.open_connection(*upstreams[shard])
            until_ended(responses(up_reader))
        return writers[shard]

    async def requests():
        target = None
        while data := await client_reader.read(CHUNK):
            if not sent_at:  # a request's head: small, so one read holds its first line and its Range header
                sent_at.append(loop.time())
                shard, data = route(data, sources, len(upstreams))
                target = await upstream(shard)
            target.write(data)
            await target.drain()

    until_ended(requests())
    try:
        await ended.wait()
    finally:
        for task in tasks:
            task.cancel()
        for writer in [*writers.values(), client_writer]:
            writer.close()


async def serve_proxy(port: int, upstream_ports: list[int], sources: dict[str, str], latency_ms: float,
                      mbps: float) -> None:
    """Listen on localhost `port` beside the other proxies (SO_REUSEPORT), relay to the shards until killed."""
    upstreams = [("127.0.0.1", p) for p in upstream_ports]
    latency_s, rate = latency_ms / 1e3, mbps * 1e6

    async def handle(reader, writer):
        try:
            await _relay(reader, writer, upstreams, sources, latency_s, rate)
        except (ConnectionError, OSError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, limit=CHUNK, reuse_port=True)
    async with server:
        await server.serve_forever()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="the port it shares with the other proxies")
    parser.add_argument("--upstream-ports", type=int, nargs="+", required=True, help="the shards' ports, in order")
    parser.add_argument("--sources", type=Path, help="JSON: each aliased key to the key of its bytes in every shard")
    parser.add_argument("--latency-ms", type=float, required=True)
    parser.add_argument("--mbps", type=float, required=True)
    args = parser.parse_args(argv)
    sources = json.loads(args.sources.read_text()) if args.sources else {}
    asyncio.run(serve_proxy(args.port, args.upstream_ports, sources, args.latency_ms, args.mbps))


if __name__ == "__main__":
    main()
