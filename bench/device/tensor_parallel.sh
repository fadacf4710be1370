#!/usr/bin/env bash
# Tensor parallelism on a host of 2 or 4 GPUs, in one call: the GPU tests (a sharded bf16 engine against PEFT at
# every size the host allows; the one-GPU graph tests beside them); the decode step against its floor
# (bench.engine.tp_decode: Llama-3-70B shapes over 4 GPUs, or Llama-3-8B over 2); then the offline throughput
# (bench/device/throughput.sh) at tensor_parallel_size 1 and 2 (and 4 on four GPUs), Llama-3-8B shapes.
#   LORA_GIT_COMMIT=$(git rev-parse --short HEAD) WHEELS=demo/whl-bench bash bench/device/tensor_parallel.sh
# PARTS ("tests decode throughput": each takes minutes; a call runs at most 10), SHAPES ("32:0 128:32":
# BATCH:ADAPTERS pairs), SIZES (1 2, and 4 where there are four GPUs), THROUGHPUT_S (150), TESTS (the three test
# files), TEST_S (300).
# Results: bench/results/<slug>-tensor-parallel-gpu-tests.log, <slug>-tp-decode-<shape>.json and
# <slug>-throughput-tp<N>-c<BATCH>-a<ADAPTERS>.json, each with its run's log beside it (.log).
source bench/device/setup.sh
log=bench/results/$SLUG-tensor-parallel-gpu-tests.log
tests=${TESTS:-tests/app/engine/test_tensor_parallel_gpu.py tests/app/engine/test_cuda_graphs.py tests/app/engine/test_fidelity.py}
parts=${PARTS:-tests decode throughput}
if [[ $parts == *tests* ]]; then
  echo "# commit ${LORA_GIT_COMMIT:-unknown}: python3 -m pytest -q -rs -m gpu $tests" > "$log"
  timeout ${TEST_S:-300} python3 -m pytest -q -rs -m gpu $tests -p no:cacheprovider >> "$log" 2>&1
  tail -40 "$log"
  cp "$log" "$OUT/"  # back even if a later part outlasts the call
fi
if [[ $parts == *decode* ]]; then
  if [ "$GPUS" -ge 4 ]; then shape=llama-3-70b tp=4; else shape=llama-3-8b tp=2; fi
  timeout 420 python3 -m bench.engine.tp_decode --tp $tp --shape $shape --compile --batches 32 \
    --out bench/results/$SLUG-tp-decode-$shape.json 2>&1 | quiet | tail -6
fi
sizes=${SIZES:-1 2 $([ "$GPUS" -ge 4 ] && echo 4)}
[[ $parts == *throughput* ]] || sizes=
for size in $sizes; do
  for shape in ${SHAPES:-32:0 128:32}; do
    tag=-tp$size-c${shape%:*}-a${shape#*:}
    BATCH=${shape%:*} ADAPTERS=${shape#*:} TAG=$tag ENGINE_ARGS="tensor_parallel_size=$size" VERBOSE=1 \
      THROUGHPUT_S=${THROUGHPUT_S:-150} bash bench/device/throughput.sh > bench/results/$SLUG-throughput$tag.log 2>&1
    echo "exit $? after $SECONDS s" >> bench/results/$SLUG-throughput$tag.log
    grep -E "tok/s|wrote|rror|exit" bench/results/$SLUG-throughput$tag.log
    cp bench/results/$SLUG-throughput$tag.log "$OUT/"
  done
done
bring_back tensor_parallel "$log" $(written "$SLUG-tp-decode-*.json") $(written "$SLUG-throughput-tp*")
