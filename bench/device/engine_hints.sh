#!/usr/bin/env bash
# Router hints against plain LRU at equal adapter memory, in the engine (bench.engine.hints; no Ray), on one GPU:
# Llama-3-8B shapes in bf16, rank-16 all-linear adapters of 83.9 MB, M = CAPACITY (8) of them (671 MB: 32 pages of
# 4 rank rows) for every arm (B: LRU with synchronous loads, A0: prefetch from the engine's queue, A: A0 + hints
# 50 ms ahead, D: all resident), N = K/2 K 4K 16K, S-LoRA lengths x 1/4, REQUESTS (32) a run (sequential:
# SEQ_REQUESTS, 300), max batch 32. WHEELS: .whl (the engine's config needs pydantic). Two calls, each under 10 minutes:
#
#   PART=warm bash bench/device/engine_hints.sh   # the host cache holds every adapter, filled before the clock;
#                                                 # measures arm D's saturating rate first and runs at 75% of it
#   PART=disk RATE=<the warm call's rate> bash bench/device/engine_hints.sh
#                                                 # a host cache of 2K adapters (< the working set), emptied and the
#                                                 # adapter files dropped from the page cache before each run
#
# Without RATE the disk call reads the warm call's result if the machine still has it, else sweeps again.
# The warm call builds the random 16 GB base and 128 adapters under demo/ (~1.5-2 min once; a warm machine keeps
# them for the disk call). WORKLOADS replaces the call's workload list (bench/workloads.py names, name@N1,N2).
# BUDGET_S: no run starts that would end past it; workloads run in the order listed, so a cut drops the last.
# Results: bench/results/<slug>-claim-<workload>[-disk].json and their plots, copied to $OUT (one tgz).
source bench/device/setup.sh
K=${CAPACITY:-8}
COMMON=(--size llama3-8b-shape --capacity "$K" --n-values $((K / 2)) "$K" $((4 * K)) $((16 * K))
        --requests "${REQUESTS:-32}" --sequential-requests "${SEQ_REQUESTS:-300}" --length-scale 0.25 --rotate-s 2
        --max-batch-size 32 --hint-lead-s 0.05)
RESULT=bench/results/$SLUG-claim-uniform.json  # the warm call's, which sets the disk call's rate
start=$(date +%s)
case "${PART:-warm}" in
warm)
  timeout 590 python3 -m bench.engine.hints "${COMMON[@]}" --sweep --time-budget-s "${BUDGET_S:-540}" \
    --workload ${WORKLOADS:-uniform "bursty-cv4@$K,$((16 * K))" sequential distinct "zipf@$((4 * K))" \
    "power-1@$((4 * K))" "power-0.3@$((4 * K))" "power-0.1@$((4 * K))"} 2>&1 | quiet | tee "$OUT/claim_warm.log" | tail -30
  python3 -c "import json; print('rate (pass RATE= to PART=disk):', json.load(open('$RESULT'))['rate'])" ;;
disk)
  rate=${RATE:-$(python3 -c "import json; print(json.load(open('$RESULT'))['rate'])" 2>/dev/null)}
  rate_args=(--sweep); [ -n "$rate" ] && rate_args=(--rate "$rate")
  timeout 590 python3 -m bench.engine.hints "${COMMON[@]}" "${rate_args[@]}" --time-budget-s "${BUDGET_S:-480}" \
    --host-cache-adapters $((2 * K)) --cold-disk \
    --workload ${WORKLOADS:-"uniform@$((4 * K)),$((16 * K))" "bursty-cv4@$((16 * K))" "zipf@$((16 * K))"} 2>&1 \
    | quiet | tee "$OUT/claim_disk.log" | tail -30 ;;
*) echo "PART is warm or disk, not ${PART}"; exit 2 ;;
esac
echo "engine hints (${PART:-warm}): $(( $(date +%s) - start )) s"
bring_back "claim_${PART:-warm}" $(written "$SLUG-claim-*")
