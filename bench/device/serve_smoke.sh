#!/usr/bin/env bash
# The Serve app deployed on this machine and checked end to end under load (bench.serve.smoke): the tiny demo,
# REPLICAS (1) GPU replicas behind ROUTER (adapter_affinity), REQUESTS (96) at CONCURRENCY (32) at once.
#   bash bench/device/serve_smoke.sh
#   REPLICAS=2 REQUESTS=128 CONCURRENCY=64 bash bench/device/serve_smoke.sh        # on nvidia-h200-x2
# Ray from WHEELS (.whl-serve). Result: bench/results/<slug>-serve-smoke-tiny-<replicas>rep-<router>.json, in $OUT.
WHEELS=${WHEELS-.whl-serve}
source bench/device/setup.sh
build_demo tiny
timeout "${SMOKE_S:-300}" python3 -m bench.serve.smoke --replicas "${REPLICAS:-1}" --router "${ROUTER:-adapter_affinity}" \
  --requests "${REQUESTS:-96}" --concurrency "${CONCURRENCY:-32}" 2>&1 | grep -E "^\{|wrote|Error|error" | tail -5
ray stop --force >/dev/null 2>&1
bring_back serve_smoke $(written "$SLUG-serve-smoke-*.json")
