#!/usr/bin/env bash
# Device calls of session 4 (1 x H100; Ray and pydantic from the wheelhouse in .whl, carried).
#   PART=tests bash bench/device/gpu_session4.sh   # the GPU tests, then the decode/prefill bench (compiled)
#   PART=serve bash bench/device/gpu_session4.sh   # Serve's TTFT overhead both engine modes, offline throughput
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
if [ "${PART:-tests}" = tests ]; then
  timeout ${TEST_S:-330} python3 -m pytest -q -rs -m gpu tests/app -p no:cacheprovider 2>&1 | tail -25 \
    | tee "$OUT/gpu_tests.log"
  timeout ${BENCH_S:-230} python3 -m bench.decode_bench --compile --runs 2 --iters 20 --out "$OUT/decode.json" 2>&1 \
    | grep '^{' | tee "$OUT/decode.log"
else
  timeout 120 python3 -m app.demo --out demo/tiny 2>&1 | tail -1
  for process in false true; do
    timeout 150 python3 -m bench.serve_overhead --size tiny --requests 100 --app-args "{\"engine_process\": $process}" \
      2>&1 | grep -E "^\{|wrote|Error" | tee -a "$OUT/overhead.log"
    ray stop --force >/dev/null 2>&1
  done
  timeout ${THROUGHPUT_S:-300} python3 -m bench.throughput_bench --size llama3-8b-shape --requests 256 --adapters 32 \
    --max-batch-size 32 --max-len 512 --dtype bfloat16 --slots 32 2>&1 | grep -vE "Warn|warn" | tail -8 \
    | tee "$OUT/throughput.log"
  cp bench/results/*serve-overhead* bench/results/*throughput* "$OUT/" 2>/dev/null
fi
