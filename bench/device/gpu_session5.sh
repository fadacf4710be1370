#!/usr/bin/env bash
# Device calls of session 5 (1 x H100; Ray and pydantic from the wheelhouse in .whl, carried).
#   PART=tests bash bench/device/gpu_session5.sh   # the GPU tests
#   PART=decode bash bench/device/gpu_session5.sh  # the decode/prefill bench (compiled), with a profile of batch 32
#   PART=serve bash bench/device/gpu_session5.sh   # Serve's TTFT overhead per transport, offline throughput
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
case "${PART:-tests}" in
tests)
  timeout ${TEST_S:-540} python3 -m pytest -q -rs -m gpu tests/app -p no:cacheprovider 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.log" ;;
decode)
  PROFILE=${PROFILE:-1} timeout ${BENCH_S:-540} python3 -m bench.decode_bench --compile --runs 3 --iters 20 \
    --out "$OUT/decode.json" 2>&1 | grep -vE "Warn|warn" | tee "$OUT/decode.log" | grep '^{' ;;
serve)
  timeout 120 python3 -m app.demo --out demo/tiny 2>&1 | tail -1
  for v in "actor 0" "grpc 0" "grpc 1"; do
    set -- $v
    RAY_SERVE_PROXY_USE_GRPC=$2 timeout 150 python3 -m bench.serve_overhead --size tiny --requests 100 \
      --app-args "{\"replica_transport\": \"$1\"}" 2>&1 | grep -E "^\{|wrote|Error" | tee -a "$OUT/overhead.log"
    ray stop --force >/dev/null 2>&1
  done
  timeout ${THROUGHPUT_S:-300} python3 -m bench.throughput_bench --size llama3-8b-shape --requests 256 --adapters 32 \
    --max-batch-size 32 --max-len 512 --dtype bfloat16 --slots 32 2>&1 | grep -vE "Warn|warn" | tail -8 \
    | tee "$OUT/throughput.log"
  cp bench/results/*serve-overhead* bench/results/*throughput* "$OUT/" 2>/dev/null ;;
esac
