#!/usr/bin/env bash
# The engine's decode step and prefill against the hardware floor measured in the same run (bench.engine.decode):
# Llama-3-8B shapes in bf16, random weights and 64 rank-16 all-linear adapters built on the GPU, the model runner
# driven directly (no engine loop, no Ray). Floors: the weight bytes over the HBM read rate of an 8 GiB sum, and
# a bf16 8192^3 GEMM for prefill.
#   bash bench/device/decode.sh                  # decode at batch 1 8 32 64, context 512, compiled graphs, 3 runs
#                                                # of 20 replays each; prefill 8 x 512; eager batch 32 (~5 min)
#   PROFILE=1 bash bench/device/decode.sh        # also torch.profiler tables: the batch-32 replays, prefill, eager
#   PART=prefill bash bench/device/decode.sh     # prefill only (not compiled, graphs up to batch 32), profiled
#   PART=prefill FUSED_NORM=0 TAG=-hf-rmsnorm bash bench/device/decode.sh   # with transformers' RMSNorm
# BATCHES (1 8 32 64), RUNS (3), ITERS (20), ARGS (more bench.engine.decode flags: --lora-block-m 32, ...),
# TAG (a suffix of the result's name), DECODE_S (the time limit). No WHEELS needed.
# Result: bench/results/<slug>-decode<TAG>.json (PART=prefill: <slug>-prefill<TAG>.json) and its log (the JSON
# lines, and the profile tables where PROFILE is set), copied to $OUT.
source bench/device/setup.sh
case "${PART:-decode}" in
decode)
  name=$SLUG-decode${TAG:-}
  timeout "${DECODE_S:-560}" python3 -m bench.engine.decode --compile --runs "${RUNS:-3}" --iters "${ITERS:-20}" \
    --batches ${BATCHES:-1 8 32 64} ${ARGS:-} --out "bench/results/$name.json" 2>&1 | quiet > "bench/results/$name.log" ;;
prefill)
  name=$SLUG-prefill${TAG:-}
  PROFILE=${PROFILE-1} timeout "${DECODE_S:-300}" python3 -m bench.engine.decode --skip-decode --batches 32 --runs 1 \
    --iters 5 ${ARGS:-} --out "bench/results/$name.json" 2>&1 | quiet > "bench/results/$name.log" ;;
*) echo "PART is decode or prefill, not ${PART}"; exit 2 ;;
esac
grep -E '"variant": "(floor|decode|prefill)' "bench/results/$name.log" | cut -c1-240
bring_back decode "bench/results/$name.json" "bench/results/$name.log"
