#!/usr/bin/env bash
# The claim at equal adapter memory, engine level (issue 10, part 2), on 1 x H100: Llama-3-8B shapes (bf16),
# rank-16 all-linear adapters of 83.9 MB, M = 8 of them (671 MB: 32 pages of 4 rank rows) for every arm
# (B, A0, A, D), N = 4 8 32 128 (K/2 to 16K), S-LoRA lengths x 1/4, 32 requests a run (sequential: 300),
# max batch 32, hints 50 ms ahead of arrival. No Ray: nothing to install. Two device calls, each under 10 min:
#
#   PART=warm bash bench/device/gpu_claim.sh   # the host cache holds all 128 adapters, filled before the clock;
#                                              # measures arm D's saturating rate first and runs at 75% of it
#   PART=disk bash bench/device/gpu_claim.sh   # the host cache holds 16 adapters (< the working set), emptied and
#                                              # the adapter files dropped from the page cache before each run;
#                                              # runs at the warm call's rate: RATE=<the rate it printed>
#                                              # (else its JSON if still on the machine, else a new sweep)
#
# The warm call builds the random 16 GB base and 128 adapters under demo/ (~1.5-2 min once; a warm machine keeps
# them for the disk call). Results: bench/results/h100-x1-claim-<workload>[-disk].json and PNGs, copied to $OUT.
# BUDGET_S: no run starts that would end past it; the workloads run in the order listed, so a cut drops the last.
# CAPACITY=K scales the matrix (M = K adapters, N = K/2 K 4K 16K, disk host cache 2K); K = 8 keeps the adapters
# on disk to 128 (10.7 GB) and the run within the time above. REQUESTS, SEQ_REQUESTS: requests per run.
# Set LORA_GIT_COMMIT before calling it: the device copy has no .git.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
K=${CAPACITY:-8}
COMMON=(--size llama3-8b-shape --capacity "$K" --n-values $((K / 2)) "$K" $((4 * K)) $((16 * K))
        --requests "${REQUESTS:-32}" --sequential-requests "${SEQ_REQUESTS:-300}" --length-scale 0.25 --rotate-s 2
        --max-batch-size 32 --hint-lead-s 0.05)
RESULT=bench/results/h100-x1-claim-uniform.json  # the warm call's; a fresh device copy may lack it: give RATE
quiet() { tr '\r' '\n' | grep -vE "Warning|warn\(|^\s*$|it/s\]|req/s\]|s/req\]"; }
start=$(date +%s)
if [ "${PART:-warm}" = warm ]; then
  timeout 590 python3 -m bench.engine_bench "${COMMON[@]}" --sweep --time-budget-s "${BUDGET_S:-540}" \
    --workload uniform "bursty-cv4@$K,$((16 * K))" sequential distinct "zipf@$((4 * K))" "power-1@$((4 * K))" \
    "power-0.3@$((4 * K))" "power-0.1@$((4 * K))" 2>&1 \
    | quiet | tee "$OUT/claim_warm.log" | tail -30
  python3 -c "import json; print('rate (pass RATE= to PART=disk):', json.load(open('$RESULT'))['rate'])"
else
  rate=${RATE:-$(python3 -c "import json; print(json.load(open('$RESULT'))['rate'])" 2>/dev/null)}
  rate_args=(--sweep); [ -n "$rate" ] && rate_args=(--rate "$rate")
  timeout 590 python3 -m bench.engine_bench "${COMMON[@]}" "${rate_args[@]}" --time-budget-s "${BUDGET_S:-480}" \
    --host-cache-adapters $((2 * K)) --cold-disk --workload "uniform@$((4 * K)),$((16 * K))" "bursty-cv4@$((16 * K))" \
    "zipf@$((16 * K))" 2>&1 \
    | quiet | tee "$OUT/claim_disk.log" | tail -30
fi
echo "claim bench ($PART): $(( $(date +%s) - start )) s"
cp bench/results/*-claim-*.json bench/results/*-claim-*.png "$OUT/" 2>/dev/null
ls -la "$OUT"
