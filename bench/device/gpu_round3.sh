#!/usr/bin/env bash
# Final H100 call of a session: decode-step bench, the engine bench's key workloads, Serve overhead.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
(python3 -m app.demo --out demo/tiny > /dev/null 2>&1 &)
echo "== forward"; timeout 170 python3 -m bench.forward_bench --size llama3-8b-shape --batch 32 --context 512 --iters 15 2>&1 \
  | grep -E "distinct|gb_per|wrote" | tee "$OUT/forward.log"
echo "== engine"; timeout 330 python3 -m bench.engine_bench --size llama3-8b-shape --slots 8 --n-values 8 32 \
  --workload uniform bursty-cv4 zipf --sweep --requests 12 --length-scale 0.0625 \
  --rotate-s 1 --time-budget-s 270 2>&1 | tr '\r' '\n' | grep -vE "Warning|warn\(|^\s*$|it/s\]|req/s\]" \
  | tee "$OUT/engine_bench.log" | tail -25
cp bench/results/h100*.json "$OUT/" 2>/dev/null; tar czf "$OUT/engine_pngs.tgz" bench/results/*-engine-*.png 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
echo "== serve overhead"; timeout 75 python3 -m bench.serve_overhead --size tiny --requests 60 2>&1 | grep -E "^\{|wrote" | tail -2
cp bench/results/h100*.json "$OUT/" 2>/dev/null
ls "$OUT"
