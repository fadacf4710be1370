#!/usr/bin/env bash
# The claim through Ray Serve (issue 10, part 2): 2 replicas, Llama-3-8B shapes (bf16), N = 128 random rank-16
# adapters of 83.9 MB, M = 8 of them (671 MB) per replica for every arm, max batch 32, max_ongoing_requests 32
# (more wait in the router, where hints are sent), S-LoRA lengths x 1/4, open-loop traces of bench/workloads.py.
# Arms, each a fresh deployment (cold device pool): A (adapter_affinity, hints), A0 (adapter_affinity,
# hints: false), serve_default (Serve's router). Ray from the wheelhouse in .whl. Set LORA_GIT_COMMIT first.
#
#   PART=all  bash bench/device/gpu_serve_claim.sh  # default: the warm part, then the disk part, as time allows
#   PART=warm bash bench/device/gpu_serve_claim.sh  # uniform@128, bursty-cv4@128, then sequential (N = 50)
#   PART=seq  bash bench/device/gpu_serve_claim.sh  # sequential alone
#   PART=disk bash bench/device/gpu_serve_claim.sh  # uniform@128 with a HOST_CACHE (16)-adapter host cache, adapter files
#                                                    # dropped from the page cache before each run
# GPUs (nvidia-smi): with 2, one per replica; with 1, both replicas share it (--gpus-per-replica 0.5). Every
# replica gets KV_GIB (12) GiB of KV cache either way, next to its 16 GB of weights. compile_decode is off
# (start-up ~1 min shorter a deployment; decode steps ~2 ms slower, the same for every arm; in the JSON).
# The warm variant's host cache holds every adapter and is filled on each replica before the first run.
#
# Time (estimates, not yet measured): pip ~20 s; the 16 GB base and 129 adapters ~2 min on a fresh machine
# (~10 s when a warm machine kept demo/); Ray ~10 s; then per arm: deploy ~60 s, host warm-up ~15 s, each run
# REQUESTS / RATE + drain ~20 s, tear-down ~10 s. PART=warm: ~2.5 + 3 x 2 min = ~8.5 min on 1 x H100 or
# 2 x H200 (the budget drops sequential, then bursty, if the deploys are slower); PART=seq ~6 min and PART=disk
# ~5.5 min on a warm machine. So a full set is three calls: PART=warm, PART=seq, PART=disk (each < 10 min).
# BUDGET_S (540): no run starts that would end past it; the call ends under 590 s.
# ARMS (default "A A0 serve_default") and TAG (a suffix of the result files' names) split the arms over calls:
# on one H100 a deployment of the two replicas took ~2.5 min (weights, graphs, host cache warm-up), so a call
# holds two arms at most: ARMS="A A0" TAG=-a-a0, then ARMS=serve_default TAG=-serve-default.
# CAPACITY (8): M, the device adapter memory of every replica, in max-rank adapters; above MAX_ONGOING it leaves
# room for hinted adapters beside those of the running requests (the production case: hundreds fit on an H100).
# REPLICAS (2): 1 takes the choice between replicas (and hints withdrawn when a request changes replica) out.
# LENGTH_SCALE (0.25) scales the S-LoRA lengths: 1 makes each request ~4x longer on the GPU, so requests wait in the
# router at rates the disk can still serve (where a hint's read can run during the wait).
# RATE (28 req/s over both replicas; a guess, not measured: one engine ran N = 128 at 13.2 req/s in the engine
# bench, 75% of its saturating rate at N = 8) and MAX_ONGOING set how many requests wait in the router; each
# result's router_wait and hints_received say how many did. Raise RATE or lower MAX_ONGOING if too few did.
# Results: bench/results/<gpu>-x<count>-serve-claim-<workload>[-disk].json, into $OUT (a tgz if > 6 files).
set -uo pipefail
start=$(date +%s)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl}/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
BUDGET_S=${BUDGET_S:-540}
kv=$(( ${KV_GIB:-12} << 30 ))
APP="{\"kv_cache_bytes\": $kv, \"compile_decode\": false, \"engine_process\": ${ENGINE_PROCESS:-false}}"
COMMON=(--launch --size llama3-8b-shape --arms ${ARMS:-A A0 serve_default} "--tag=${TAG:-}" --replicas "${REPLICAS:-2}" --capacity "${CAPACITY:-8}" --adapters 128
        --batch 32 --max-ongoing "${MAX_ONGOING:-32}" --rate "${RATE:-28}" --num-requests "${REQUESTS:-192}"
        --sequential-requests "${SEQ_REQUESTS:-300}" --length-scale "${LENGTH_SCALE:-0.25}" --rotate-s 2 --app-args "$APP")
[ "$gpus" -lt 2 ] && COMMON+=(--gpus-per-replica 0.5)
quiet() { tr '\r' '\n' | grep -vE "INFO|WARN|Warning|warn\(|^\s*$|it/s\]|Loading weights"; }
claim() {  # claim <log name> <serve_bench args...>: one serve_bench call within what is left of the budget
  local name=$1; shift
  local left=$(( BUDGET_S - ($(date +%s) - start) )) hard=$(( 585 - ($(date +%s) - start) ))
  if [ "$left" -lt 150 ]; then echo "== $name: skipped, $left s of the budget left"; return; fi
  echo "== $name ($left s left)"
  timeout $(( left + 40 < hard ? left + 40 : hard )) python3 -m bench.serve_bench "${COMMON[@]}" \
    --time-budget-s $(( left - 15 )) "$@" 2>&1 | quiet | tee "$OUT/$name.log" | tail -12
  ray stop --force >/dev/null 2>&1
}
case "${PART:-all}" in
  warm) claim serve_claim_warm --workload uniform@128 bursty-cv4@128 sequential ;;
  seq) claim serve_claim_seq --workload sequential ;;
  bursty) claim serve_claim_bursty --workload bursty-cv4@128 ;;
  disk) claim serve_claim_disk --workload uniform@128 --host-cache-adapters "${HOST_CACHE:-16}" --cold-disk ;;
  *) claim serve_claim_warm --workload uniform@128 bursty-cv4@128 sequential
     claim serve_claim_disk --workload uniform@128 --host-cache-adapters 16 --cold-disk ;;
esac
echo "serve claim (${PART:-all}, $gpus GPU): $(( $(date +%s) - start )) s"
shopt -s nullglob
results=(bench/results/*-serve-claim-*.json)
if [ $(( ${#results[@]} + $(ls "$OUT" | wc -l) )) -gt 6 ]; then
  tar czf "$OUT/serve_claim.tgz" "${results[@]}" "$OUT"/serve_claim_*.log && rm -f "$OUT"/serve_claim_*.log
else
  cp "${results[@]}" "$OUT/" 2>/dev/null
fi
ls -la "$OUT"
