#!/usr/bin/env bash
# The engine's decode step and prefill against the hardware floor measured in the same run (bench.engine.decode):
# a published model's shapes in bf16 (Llama-3-8B by default), random weights and 64 rank-16 all-linear adapters
# built on the GPU, the model runner driven directly (no engine loop, no Ray). Floors: the weight bytes over the
# HBM read rate of an 8 GiB sum, and a bf16 8192^3 GEMM for prefill.
#   bash bench/device/decode.sh                  # decode at batch 1 8 32 64, context 512, compiled graphs, 3 runs
#                                                # of 20 replays each; prefill 8 x 512; eager batch 32 (~5 min)
#   SHAPE=qwen2.5-7b bash bench/device/decode.sh # Qwen2.5-7B's shapes (SHAPE=gemma-2-9b: Gemma-2-9B's)
#   PROFILE=1 bash bench/device/decode.sh        # also torch.profiler tables: the batch-32 replays (ARGS=
#                                                # "--profile-batch N": batch N's), prefill, eager
#   PART=prefill bash bench/device/decode.sh     # prefill only (not compiled, graphs up to batch 32), profiled
#   PART=prefill FUSED_NORM=0 TAG=-hf-rmsnorm bash bench/device/decode.sh   # with transformers' RMSNorm
# SHAPE (llama-3-8b, qwen2.5-7b, gemma-2-9b), BATCHES (1 8 32 64), RUNS (3), ITERS (20), ARGS (more
# bench.engine.decode flags: --lora-block-m 32, ...), TAG (a suffix of the result's name), DECODE_S (the time
# limit). WHEELS: .whl (the engine's config needs pydantic). All three shapes in one call: decode_shapes.sh.
# Result: bench/results/<slug>-decode[-<shape>]<TAG>.json (PART=prefill: <slug>-prefill[-<shape>]<TAG>.json; the
# shape is named unless it is llama-3-8b) and its log (the JSON lines, and the profile tables where PROFILE is
# set), copied to $OUT.
source bench/device/setup.sh
shape=${SHAPE:-llama-3-8b}
suffix=; shape_args=()  # the default shape runs the command docs/benchmarks.md gives, under its result names
[ "$shape" != llama-3-8b ] && suffix=-$shape && shape_args=(--shape "$shape")
case "${PART:-decode}" in
decode)
  name=$SLUG-decode$suffix${TAG:-}
  timeout "${DECODE_S:-560}" python3 -m bench.engine.decode "${shape_args[@]}" --compile --runs "${RUNS:-3}" \
    --iters "${ITERS:-20}" --batches ${BATCHES:-1 8 32 64} ${ARGS:-} --out "bench/results/$name.json" 2>&1 \
    | quiet > "bench/results/$name.log" ;;
prefill)
  name=$SLUG-prefill$suffix${TAG:-}
  PROFILE=${PROFILE-1} timeout "${DECODE_S:-300}" python3 -m bench.engine.decode "${shape_args[@]}" --skip-decode \
    --batches 32 --runs 1 --iters 5 ${ARGS:-} --out "bench/results/$name.json" 2>&1 | quiet > "bench/results/$name.log" ;;
*) echo "PART is decode or prefill, not ${PART}"; exit 2 ;;
esac
grep -E '"variant": "(floor|decode|prefill)' "bench/results/$name.log" | cut -c1-400
bring_back decode $(written "$name.json") $(written "$name.log")  # only what this call wrote
