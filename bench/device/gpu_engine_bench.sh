#!/usr/bin/env bash
# One device call (1 x H100, under 10 min): the engine benchmark on Llama-3-8B shapes (bf16, S = 8,
# rank-16 all-linear adapters of 83.9 MB). Several calls split the work; the variables below pick each
# call's share, and a warm machine keeps the random 16 GB base and the adapters under demo/ between calls
# (building them takes about 90 s once). Set LORA_GIT_COMMIT before calling it: the device copy has no .git.
#
#   WORKLOADS="uniform" NVALUES="4 8 16 32 128" ARMS=ABCDE bash bench/device/gpu_engine_bench.sh
#   WORKLOADS="zipf power-0.1 ..." NVALUES="32" ARMS=ABC RATE=4.2 bash bench/device/gpu_engine_bench.sh
#
# RATE unset: measure arm A's saturating rate first (a burst; uniform, the middle N) and run at 75% of it.
# LENGTHS=slora|fixed, LENGTH_SCALE shrinks S-LoRA's U[8, 512) lengths, REQUESTS per run, BUDGET_S: no run
# starts that would end past it (A and B run first, so a cut keeps the main comparison).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rate_args=(--sweep)
[[ -n "${RATE:-}" ]] && rate_args=(--rate "$RATE")
start=$(date +%s)
timeout $(( ${BUDGET_S:-480} + 60 )) python3 -m bench.engine_bench --size llama3-8b-shape --slots 8 \
  --n-values ${NVALUES:-4 8 16 32 128} --workload ${WORKLOADS:-uniform} --arms "${ARMS:-ABCDE}" "${rate_args[@]}" \
  --requests "${REQUESTS:-40}" --lengths "${LENGTHS:-slora}" --length-scale "${LENGTH_SCALE:-0.25}" --rotate-s 2 \
  --time-budget-s "${BUDGET_S:-480}" 2>&1 \
  | tr '\r' '\n' | grep -vE "Warning|warn\(|^\s*$|it/s\]|req/s\]|rate/s\]|s/req\]" | tee -a "$OUT/engine_bench.log" | tail -40
echo "engine bench: $(( $(date +%s) - start )) s"
tar czf "$OUT/engine_results.tgz" bench/results/*-engine-*.json bench/results/*-engine-*.png 2>/dev/null
ls -la "$OUT"
