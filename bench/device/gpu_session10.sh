#!/usr/bin/env bash
# Session 10, one device call (1 x H100; Ray from the wheelhouse in WHEELS, default .whl): streaming through
# Serve under HTTP load (Llama-3-8B shapes, 1 replica, the engine in its own process, compile_decode off for
# a shorter start-up, the same for every run), once per stream_interval_ms in INTERVALS (default "0 20 50"):
# output tokens/s, TTFT, chunk gaps, and the replica's step timing. Set LORA_GIT_COMMIT first.
#   bash bench/device/gpu_session10.sh
set -uo pipefail
source bench/device/setup.sh
for ms in ${INTERVALS:-0 20 50}; do
  echo "== serve under HTTP load (llama3-8b-shape, 1 replica, engine process, stream_interval_ms $ms)"
  timeout ${SERVE_S:-180} python3 -m bench.serve_bench --launch --size llama3-8b-shape --adapters 32 --slots 32 \
    --batch 32 --num-requests ${REQUESTS:-256} --max-tokens 128 --prompt-words 64 --max-concurrency 64 \
    --app-args "{\"engine_process\": true, \"compile_decode\": false, \"stream_interval_ms\": $ms}" \
    --tag="-engine-process-stream${ms}ms" 2>&1 | grep -vE "^\s*$|INFO|WARN|it/s\]|warn|^\(" | tail -16 \
    | tee "$OUT/serve-stream${ms}ms.log"
  ray stop --force >/dev/null 2>&1
done
cp bench/results/*serve-uniform-llama3-8b-shape-engine-process-stream*.json "$OUT/" 2>/dev/null
ls "$OUT"
