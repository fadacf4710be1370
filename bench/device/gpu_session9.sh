#!/usr/bin/env bash
# Device calls of session 9 (1 x H100).
#   PART=decode bash bench/device/gpu_session9.sh  # the decode bench (8B shapes, batch 8 / 32 / 64, compiled
#       graphs, a kernel profile at batch 32), then the GPU tests of the LoRA kernels and the graphs. At commit
#       22b0b5d it ran twice, with the LoRA kernels launched with programmatic dependent launch and without
#       (`--no-lora-pdl`, `h100-x1-decode-session9-{pdl,no-pdl}*`); that code was measured, no faster, and dropped.
#   PART=tests WHEELS=.whl bash bench/device/gpu_session9.sh  # every GPU test
source bench/device/setup.sh
case "${PART:-decode}" in
decode)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  PROFILE=1 timeout ${DECODE_S:-200} python3 -m bench.decode_bench --compile --runs 3 --iters 20 --batches 8 32 64 \
    --out "$OUT/h100-x1-decode-session9${TAG:-}.json" 2>&1 | quiet > "$OUT/decode${TAG:-}.log"
  grep -E '"variant": "(floor|decode|prefill)' "$OUT/decode${TAG:-}.log" | cut -c1-260
  timeout ${TEST_S:-300} python3 -m pytest -q -m gpu tests/app/test_lora_kernels.py tests/app/test_gpu.py \
    -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu_tests_lora.log" ;;
tests)
  timeout ${TEST_S:-400} python3 -m pytest -q -rs -m gpu tests/app -p no:cacheprovider 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.log" ;;
esac
