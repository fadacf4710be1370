#!/usr/bin/env bash
# Router hints with the adapters in a remote store, measured through Ray Serve (bench.serve.load --arms
# --adapter-store s3, bench/serve/store.py): N (256) rank-16 Llama-3-8B-shape adapters of 83.9 MB in moto's S3
# server, behind a proxy that delays each request's first byte by LATENCY_MS (100) and caps each connection at MBPS
# (150) MB/s. DISTINCT (32) adapters are generated; the N adapters' weights in the store are aliases of their bytes.
# The store runs as SHARDS (4) moto processes, each holding the DISTINCT weights files, behind PROXIES (2) proxy
# processes that spread one object's ranges over the shards, so that its throughput grows with connections as a
# real store's does, on one object too (one moto process delivered 253 MB/s over 8 connections on the H100's host);
# the floor in the result says what it delivered. STORE_CORES (0: any core) puts the store's processes alone on
# that many of the host's cores, and Ray, the replicas and the benchmark's client on the others, as a store
# elsewhere would leave the node's CPU to the server.
# Each arm of ARMS (A A0 serve_default) is a fresh deployment of REPLICAS (1) replicas whose node cache starts empty,
# NODE_CACHE adapters large (default: all N); no host cache is filled beforehand. The first two arms are the pair
# compared; a third runs where time is left. One WORKLOAD (uniform; zipf: Zipf α 1.5; bursty-cv4) of REQUESTS (192)
# at RATE (6 req/s), S-LoRA lengths x LENGTH_SCALE (0.25); per replica CAPACITY (16) max-rank adapters of device
# memory, HOST_CACHE (48) of host cache, MAX_ONGOING (8) requests (the rest wait in the router, where hints are
# sent), KV_GIB (12) GiB of KV cache, compile_decode off, the engine loop on a thread unless ENGINE_PROCESS=true.
# HINT_DEPTH (48): how many waiting requests behind those Serve routes at a time A's router hints (0: only those).
# SAMPLE_STALLS_MS (20): the replicas sample where their engine thread is while a host part of its loop runs longer
# (per_replica.step_timing.stalls; 0: off).
#
#   bash bench/device/serve_remote.sh                              # uniform: A, A0, then serve_default if time is left
#   WORKLOAD=zipf ARMS="A A0" bash bench/device/serve_remote.sh
#   WORKLOAD=bursty-cv4 ARMS=serve_default TAG=-serve-default bash bench/device/serve_remote.sh
#   LATENCY_MS=30 MBPS=500 TAG=-30ms-500mbps bash bench/device/serve_remote.sh   # a nearer store
#
# Wheels: WHEELS (.whl-serve) must hold moto's S3 server and s3fs besides Ray, or STORE_WHEELS names a second
# wheelhouse that does (both in the call's carry; `bash bench/device/store_wheels.sh demo/whl-store` builds one);
# the call stops at once where a 1 MB round trip through the emulated store fails.
# Phases on the H100's host: wheels and the store check ~40 s; the 16 GB base ~20-25 s to write; the upload 38-53 s
# (the DISTINCT weights files into every shard, 257 configs; 85 s with SHARDS=8); then 107-133 s to deploy the first arm
# (the base read from a cold page cache, CUDA graphs, each replica registering the N remote adapters; longer on a
# fresh machine) and 65-89 s each later one, and 35-70 s to play the trace. A and A0 at 1 replica took 374-383 s
# with 192 requests at RATE=6 or 7.5, and 430-450 s with 160 at RATE=5. One call fits A and A0 at 1 replica and 192 requests
# (BUDGET_S=548: 494 s), all three arms at 1 replica, 128 requests and RATE=3.5 (BUDGET_S=560: 542 s) or 160
# requests and RATE=5 (523 s; bursty-cv4's pair fitted only on a machine that had run a call before), or all three
# arms at 2 replicas and 160 requests (478 s). A and A0 with LENGTH_SCALE=0.5 at RATE=5 took 426-512 s; where the
# upload took 53 s and the first deploy 145 s (264 s in), the Zipf pair did not fit. The bench checks before its first
# run that both arms of the pair fit BUDGET_S (520, from the call's start), and starts no run that would end past
# it. The call ends by 560 s.
# Results: bench/results/<slug>-serve-remote-<workload><TAG>.json, with the store's measured floor, copied to $OUT
# beside the call's log.
call_start=$(date +%s)
WHEELS=${WHEELS-.whl-serve}
source bench/device/setup.sh
python3 -c "import aiohttp, fsspec; print('aiohttp', aiohttp.__version__, 'fsspec', fsspec.__version__)"
if ! timeout 60 python3 -m bench.serve.store --objects 1 --object-mb 1 > "$OUT/store_check.log" 2>&1; then
  tail -5 "$OUT/store_check.log"; echo "the emulated store does not run here: see STORE_WHEELS"; exit 1
fi
BUDGET_S=${BUDGET_S:-520}  # from the call's start, as the 560 s limit
N=${N:-256}
APP="{\"kv_cache_bytes\": $(( ${KV_GIB:-12} << 30 )), \"compile_decode\": false, \"engine_process\": ${ENGINE_PROCESS:-false},
     \"hint_depth\": ${HINT_DEPTH:-48}, \"sample_stalls_ms\": ${SAMPLE_STALLS_MS:-20}}"
ARGS=(--launch --size llama3-8b-shape --arms ${ARMS:-A A0 serve_default} "--tag=${TAG:-}" --replicas "${REPLICAS:-1}"
      --workload "${WORKLOAD:-uniform}@$N" --adapter-store s3 --store-latency-ms "${LATENCY_MS:-100}"
      --store-mbps "${MBPS:-150}" --store-shards "${SHARDS:-4}" --store-proxies "${PROXIES:-2}" \
      --store-cores "${STORE_CORES:-0}"
      --store-distinct "${DISTINCT:-32}" --capacity "${CAPACITY:-16}"
      --host-cache-adapters "${HOST_CACHE:-48}" --batch 32 --max-ongoing "${MAX_ONGOING:-8}" --rate "${RATE:-6}"
      --num-requests "${REQUESTS:-192}" --length-scale "${LENGTH_SCALE:-0.25}" --rotate-s 2 --app-args "$APP")
[ -n "${NODE_CACHE:-}" ] && ARGS+=(--node-cache-adapters "$NODE_CACHE")
[ "$GPUS" -lt "${REPLICAS:-1}" ] && ARGS+=(--gpus-per-replica "$(python3 -c "print($GPUS / ${REPLICAS:-1})")")
left=$(( BUDGET_S - ($(date +%s) - call_start) )) hard=$(( 560 - ($(date +%s) - call_start) ))
echo "== serve_remote ${WORKLOAD:-uniform}@$N ($left s left)"
timeout $(( left + 30 < hard ? left + 30 : hard )) python3 -m bench.serve.load "${ARGS[@]}" \
  --time-budget-s $(( left - 15 )) 2>&1 | quiet | tee "$OUT/serve_remote.log" \
  | grep -E "^adapter store|^  floor|N=[0-9]+ |^wrote|^  bench|^no run|would pass|deployed and warmed|Error|Traceback" | tail -12
ray stop --force >/dev/null 2>&1
echo "serve remote (${WORKLOAD:-uniform}, $GPUS GPU): $(( $(date +%s) - call_start )) s"
bring_back serve_remote $(written "$SLUG-serve-remote-*.json")
