#!/usr/bin/env bash
# Router hints measured through Ray Serve (bench.serve.load --arms, run by bench/serve/claim.py): each arm a fresh
# deployment of REPLICAS (2) replicas at the same device adapter memory, Llama-3-8B shapes in bf16, N = 128 random
# rank-16 adapters of 83.9 MB, open-loop traces of bench/workloads.py with S-LoRA lengths x LENGTH_SCALE (0.25).
# Arms: A (the adapter-affinity router with hints), A0 (the same router, hints: false), serve_default (Serve's
# router). On one GPU the replicas share it (--gpus-per-replica 0.5); with 2, one each. Every replica gets KV_GIB
# (12) GiB of KV cache, compile_decode off (a deployment starts ~1 min sooner; the same for every arm) and its engine
# loop on a thread unless ENGINE_PROCESS=true. Ray from WHEELS (.whl-serve: HTTP through HAProxy, as `make serve`).
#
#   PART=warm bash bench/device/serve_claim.sh   # uniform@128, bursty-cv4@128, then sequential (N = 50); the host
#                                                # cache holds every adapter and is filled on each replica first
#   PART=seq  bash bench/device/serve_claim.sh   # sequential alone
#   PART=bursty bash bench/device/serve_claim.sh # bursty-cv4@128 alone
#   PART=disk bash bench/device/serve_claim.sh   # uniform@128 with a HOST_CACHE (16)-adapter host cache, the adapter
#                                                # files dropped from the page cache before each run
#   PART=all  bash bench/device/serve_claim.sh   # the default: warm, then disk, as the budget allows
#   PART=disk ARMS="A A0" REPLICAS=1 CAPACITY=16 MAX_ONGOING=8 HOST_CACHE=48 RATE=6 \
#     TAG=-1replica-cap16-ongoing8-host48-rate6 bash bench/device/serve_claim.sh   # adapter memory twice the running set
#
# A deployment of two 8B-shape replicas takes ~1.5-2.5 min (weights, graphs, host cache), so a call holds two arms:
# ARMS (A A0 serve_default) and TAG (a suffix of the result names) split them over calls.
# CAPACITY (8): M per replica in max-rank adapters; above MAX_ONGOING it leaves room for hinted adapters beside
# those of the running requests. MAX_ONGOING (32) and RATE (28 req/s over all replicas) set how many requests wait
# in the router, where hints are sent: each result's router_wait and hints_received say how many did.
# REQUESTS (192) and SEQ_REQUESTS (300) a run. BUDGET_S (540): no run starts that would end past it.
# Results: bench/results/<slug>-serve-claim-<workload>[-disk]<TAG>.json, copied to $OUT (one tgz past 8 files)
# beside the call's logs.
WHEELS=${WHEELS-.whl-serve}
source bench/device/setup.sh
start=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
APP="{\"kv_cache_bytes\": $(( ${KV_GIB:-12} << 30 )), \"compile_decode\": false, \"engine_process\": ${ENGINE_PROCESS:-false}}"
COMMON=(--launch --size llama3-8b-shape --arms ${ARMS:-A A0 serve_default} "--tag=${TAG:-}" --replicas "${REPLICAS:-2}"
        --capacity "${CAPACITY:-8}" --adapters 128 --batch 32 --max-ongoing "${MAX_ONGOING:-32}" --rate "${RATE:-28}"
        --num-requests "${REQUESTS:-192}" --sequential-requests "${SEQ_REQUESTS:-300}"
        --length-scale "${LENGTH_SCALE:-0.25}" --rotate-s 2 --app-args "$APP")
[ "$GPUS" -lt 2 ] && COMMON+=(--gpus-per-replica 0.5)
claim() {  # claim <log name> <bench.serve.load args...>: one call of the bench within what is left of the budget
  local name=$1; shift
  local left=$(( BUDGET_S - ($(date +%s) - start) )) hard=$(( 585 - ($(date +%s) - start) ))
  if [ "$left" -lt 150 ]; then echo "== $name: skipped, $left s of the budget left"; return; fi
  echo "== $name ($left s left)"
  timeout $(( left + 40 < hard ? left + 40 : hard )) python3 -m bench.serve.load "${COMMON[@]}" \
    --time-budget-s $(( left - 15 )) "$@" 2>&1 | quiet | tee "$OUT/$name.log" | tail -12
  ray stop --force >/dev/null 2>&1
}
case "${PART:-all}" in
  warm) claim serve_claim_warm --workload uniform@128 bursty-cv4@128 sequential ;;
  seq) claim serve_claim_seq --workload sequential ;;
  bursty) claim serve_claim_bursty --workload bursty-cv4@128 ;;
  disk) claim serve_claim_disk --workload uniform@128 --host-cache-adapters "${HOST_CACHE:-16}" --cold-disk ;;
  all) claim serve_claim_warm --workload uniform@128 bursty-cv4@128 sequential
       claim serve_claim_disk --workload uniform@128 --host-cache-adapters "${HOST_CACHE:-16}" --cold-disk ;;
  *) echo "PART is warm, seq, bursty, disk or all, not ${PART}"; exit 2 ;;
esac
echo "serve claim (${PART:-all}, $GPUS GPU): $(( $(date +%s) - start )) s"
bring_back serve_claim $(written "$SLUG-serve-claim-*.json")
