#!/usr/bin/env bash
# Device calls of session 6 (1 x H100).
#   PART=prefill bash bench/device/gpu_session6.sh  # prefill 8 x 512 with transformers' RMSNorm and the fused one,
#                                                   # profiled (no compile, graphs up to batch 32 only: quick)
#   PART=decode bash bench/device/gpu_session6.sh   # the decode/prefill bench as in README (compiled, 3 runs)
#   PART=tests bash bench/device/gpu_session6.sh    # the GPU tests, then a mixed step eager and replayed
#   PART=throughput bash bench/device/gpu_session6.sh  # offline throughput: mixed steps eager (max_graph_tokens=0)
#                                                    # and replayed (512, with a 480-token prefill budget)
# Set LORA_GIT_COMMIT before calling it: the device copy has no .git.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-}
quiet() { grep -vE "Warn|warn\(|_warn_once"; }
case "${PART:-prefill}" in
prefill)
  for fused in 0 1; do
    FUSED_NORM=$fused PROFILE=1 timeout 200 python3 -m bench.decode_bench --skip-decode --batches 32 --runs 1 \
      --iters 5 --out "$OUT/prefill-fused-norm-$fused.json" 2>&1 | quiet | tee "$OUT/prefill-fused-norm-$fused.log" \
      | grep -E '^\{"variant": "prefill'
  done ;;
decode)
  PROFILE=${PROFILE:-1} timeout ${BENCH_S:-540} python3 -m bench.decode_bench --compile --runs 3 --iters 20 \
    --out "$OUT/decode.json" 2>&1 | quiet | tee "$OUT/decode.log" | grep '^{' ;;
tests)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
  timeout ${TEST_S:-330} python3 -m pytest -q -rs -m gpu tests/app -p no:cacheprovider 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.log"
  for prefill in 1x64 2x224; do
    for tokens in 0 512; do
      timeout 150 python3 -m bench.mixed_step_profile --prefill $prefill --max-graph-tokens $tokens --rows 25 2>&1 \
        | quiet | tee "$OUT/mixed-$prefill-graph-$tokens.log" | grep "^mixed step"
    done
  done ;;
throughput)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
  for v in "0 2048" "512 480"; do
    set -- $v
    timeout ${THROUGHPUT_S:-280} python3 -m bench.throughput_bench --size llama3-8b-shape --requests 256 \
      --adapters 32 --max-batch-size 32 --max-len 512 --dtype bfloat16 --slots 32 --engine-arg max_graph_tokens=$1 \
      --engine-arg max_prefill_tokens_per_step=$2 --note "max_graph_tokens=$1 max_prefill_tokens_per_step=$2" \
      --out "$OUT/throughput-graph-$1-budget-$2.json" 2>&1 | quiet | tail -6
  done ;;
esac
