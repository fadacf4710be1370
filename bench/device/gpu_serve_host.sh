#!/usr/bin/env bash
# One device call (1 x H100, Ray from the wheelhouse in .whl): the engine's host time per step inside its
# Serve replica under HTTP load (Llama-3-8B shapes, compiled decode graphs), with the engine loop on a
# thread of the replica and in its own process, and Serve's overhead on TTFT both ways.
#   bash bench/device/gpu_serve_host.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
for mode in thread process; do
  process=$([ $mode = process ] && echo true || echo false)
  echo "== serve under HTTP load (llama3-8b-shape, 1 replica, engine loop: $mode)"
  timeout ${SERVE_S:-270} python3 -m bench.serve_bench --launch --size llama3-8b-shape --adapters 32 --slots 32 \
    --batch 32 --num-requests ${REQUESTS:-256} --max-tokens 128 --prompt-words 64 --max-concurrency 64 \
    --app-args "{\"engine_process\": $process}" --tag="-engine-$mode" 2>&1 \
    | grep -vE "^\s*$|INFO|WARN|it/s\]|warn" | tail -18 | tee "$OUT/serve-$mode.log"
  ray stop --force >/dev/null 2>&1
done
cp bench/results/*serve-uniform-llama3-8b-shape*.json "$OUT/" 2>/dev/null
