#!/usr/bin/env bash
# What downloads from the emulated store cost a Python step loop when they run in its process, against a child
# process (bench/serve/fetch_contention.py): 8 adapters of 84 MB at once, 4 shards, 2 proxies, 100 ms to the first
# byte, 150 MB/s per connection. Needs the host only (no GPU), pydantic (the engine's config) and the store's wheels;
# .whl without Ray holds the first, since .whl and the store's wheels together pass what a call carries:
#
#   mkdir -p demo/whl-bench && cp .whl/*.whl demo/whl-bench/ && rm demo/whl-bench/ray-*.whl    # here, once
#   WHEELS=demo/whl-bench STORE_WHEELS=demo/whl-store bash bench/device/fetch_contention.sh    # carry both; ~2 min
#
# Result: bench/results/<slug>-fetch-contention.json, copied to $OUT.
source bench/device/setup.sh
timeout 400 python3 -m bench.serve.fetch_contention "$@" 2>&1 | quiet | tee "$OUT/fetch_contention.log"
bring_back fetch_contention $(written "$SLUG-fetch-contention.json")
