#!/usr/bin/env bash
# One download that a request waits for, started behind fetches ahead from the emulated store
# (bench/serve/urgent_fetch.py): 8 fetches ahead of 84 MB, 4 shards, 2 proxies, 100 ms to the first byte, 150 MB/s
# per connection; the waited-for download taking the connections first, in order, and alone. Needs the host only
# (no GPU), and the store's wheels:
#
#   WHEELS= STORE_WHEELS=demo/whl-store bash bench/device/urgent_fetch.sh     # carry demo/whl-store; ~2 minutes
#
# Result: bench/results/<slug>-urgent-fetch.json, copied to $OUT.
source bench/device/setup.sh
timeout 400 python3 -m bench.serve.urgent_fetch "$@" 2>&1 | quiet | tee "$OUT/urgent_fetch.log"
bring_back urgent_fetch $(written "$SLUG-urgent-fetch.json")
