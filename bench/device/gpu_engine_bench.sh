#!/usr/bin/env bash
# One device call (1 x H100, under 10 min): the engine benchmark on Llama-3-8B shapes, every workload.
# It builds the random 16 GB base and 128 random rank-16 all-linear adapters (84 MB each) first, since
# demo/ is not carried (about 60 s on an H100 with the first engine). To fit one call it runs N = S, 4S,
# 16S (S = 8), 12 requests a run, lengths x 1/16 (S-LoRA's U[8, 512) becomes about U[1, 32)), the hot set
# moving every second, and stops starting runs at 500 s (A and B run first); see bench/engine_bench.py.
# Set LORA_GIT_COMMIT before calling it: the device copy has no .git.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
start=$(date +%s)
timeout 575 python3 -m bench.engine_bench --size llama3-8b-shape --slots 8 --n-values 8 32 128 --workload all \
  --sweep --sweep-start 2 --sweep-window-s 3 --requests 12 --length-scale 0.0625 --rotate-s 1 \
  --idle-poll-s "${IDLE_POLL_S:-0}" --time-budget-s 500 2>&1 \
  | tr '\r' '\n' | grep -vE "Warning|warn\(|^\s*$" | awk '!/req\/s|s\/req|rate\/s|s\/rate/ || NR % 25 == 0' \
  | tee "$OUT/engine_bench.log" | tail -30
echo "engine bench: $(( $(date +%s) - start )) s"
tar czf "$OUT/engine_results.tgz" bench/results/*-engine-*.json bench/results/*-engine-*.png 2>/dev/null
ls -la "$OUT"
