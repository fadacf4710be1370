#!/usr/bin/env bash
# One device call (1 x H100): the GPU tests, then the engine-core decode/prefill bench against the floor.
#   LORA_GIT_COMMIT=$(git rev-parse HEAD) bash bench/device/gpu_engine_core.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${TEST_S:-240} python3 -m pytest -q -rs -m gpu tests/app -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
timeout ${BENCH_S:-300} python3 -m bench.decode_bench ${DECODE_ARGS:-} --out "$OUT/decode.json" 2>&1 \
  | grep -v Warning | tee "$OUT/decode.log"
