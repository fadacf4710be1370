#!/usr/bin/env bash
# FP8 base weights on one GPU, in one call: the FP8 GPU tests (the GEMM against its float32 arithmetic, eagerly and
# in a CUDA graph; an FP8 engine's tokens against PEFT over the same FP8 base; a compressed-tensors checkpoint
# against quantizing at load), then the offline throughput (bench/device/throughput.sh) with quantization=fp8,
# base and 32 adapters, at 32 and 128 sequences. About 8 minutes on a fresh machine.
#   LORA_GIT_COMMIT=$(git rev-parse --short HEAD) WHEELS=demo/whl-bench bash bench/device/fp8.sh
# WHEELS: .whl plus compressed-tensors and loguru (the checkpoint test writes its checkpoint with them).
# SHAPES ("32:0 32:32 128:0 128:32": BATCH:ADAPTERS pairs), THROUGHPUT_S (150 each).
# Results: bench/results/<slug>-fp8-gpu-tests.log and <slug>-throughput-fp8-c<BATCH>-a<ADAPTERS>.json, in $OUT.
source bench/device/setup.sh
log=bench/results/$SLUG-fp8-gpu-tests.log
echo "# commit ${LORA_GIT_COMMIT:-unknown}: python3 -m pytest -q -rs -m gpu tests/app/model/test_fp8_gpu.py" > "$log"
timeout 240 python3 -m pytest -q -rs -m gpu tests/app/model/test_fp8_gpu.py -p no:cacheprovider 2>&1 | tail -20 \
  | tee -a "$log"
for shape in ${SHAPES:-32:0 32:32 128:0 128:32}; do
  BATCH=${shape%:*} ADAPTERS=${shape#*:} TAG=-fp8-c${shape%:*}-a${shape#*:} ENGINE_ARGS="quantization=fp8" \
    THROUGHPUT_S=${THROUGHPUT_S:-150} bash bench/device/throughput.sh 2>&1 | grep -E "tok/s|wrote|Error|error"
done
bring_back fp8 "$log" $(written "$SLUG-throughput-fp8-*.json")
