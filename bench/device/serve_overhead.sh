#!/usr/bin/env bash
# Serve's overhead on TTFT (bench.serve.overhead): the tiny demo, one replica, REQUESTS (100) requests one at a
# time, each stream read to its end; TTFT through HTTP + Serve minus TTFT calling the engine in process. Once per
# engine loop in LOOPS and HTTP path in PATHS. Ray from WHEELS (.whl-serve, which has HAProxy).
#   bash bench/device/serve_overhead.sh              # LOOPS="thread process", PATHS=haproxy (as `make serve`; ~3 min)
#   PATHS="haproxy serve-proxy" LOOPS=thread bash bench/device/serve_overhead.sh    # also Serve's proxy (bare
#                                                    # `serve run`)
# OVERHEAD_S (240 s a run). Results: bench/results/<slug>-serve-overhead-tiny[-engine-process]-replica-grpc-
# {haproxy,proxy-actor}.json (the bench names them by what ran), copied to $OUT.
WHEELS=${WHEELS-.whl-serve}
source bench/device/setup.sh
build_demo tiny
for path in ${PATHS:-haproxy}; do
  for loop in ${LOOPS:-thread process}; do
    proxy=(); [ "$path" = serve-proxy ] && proxy=(--serve-proxy)
    process=$([ "$loop" = process ] && echo true || echo false)
    echo "== Serve's overhead on TTFT: $path, engine loop on a $loop"
    timeout "${OVERHEAD_S:-240}" python3 -m bench.serve.overhead --size tiny --requests "${REQUESTS:-100}" "${proxy[@]}" \
      --app-args "{\"engine_process\": $process}" 2>&1 | quiet | grep -E "^\{|wrote"
    ray stop --force >/dev/null 2>&1
  done
done
bring_back serve_overhead $(written "$SLUG-serve-overhead-*.json")
