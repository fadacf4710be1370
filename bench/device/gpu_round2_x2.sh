#!/usr/bin/env bash
# 2 x H200: the Serve app with two GPU replicas, then 1 vs 2 replicas and our router vs Serve's default.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 120 python3 -m app.demo --out demo/tiny 2>&1 | tail -1
echo "== serve smoke (2 GPU replicas)"
timeout 240 python3 -m bench.serve_smoke --replicas 2 --requests 128 --concurrency 64 2>&1 | grep -E "^\{|wrote" | tail -3
echo "== serve bench: replicas x router"
timeout 420 python3 -m bench.serve_bench --launch --replicas 1 2 --router adapter_affinity serve_default \
  --size tiny --slots 4 --batch 32 --num-requests 400 --rate 0 --max-tokens 64 --workload uniform 2>&1 \
  | grep -vE "^\s*$|requests:|INFO|WARN" | tail -60
cp bench/results/*.json "$OUT/" 2>/dev/null
