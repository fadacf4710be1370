#!/usr/bin/env bash
# Where a mixed step's time goes (bench.engine.mixed_step): 32 decode rows at context 512 plus prompt chunks over
# 8 rank-16 adapters, Llama-3-8B shapes, run by the model runner eagerly (GRAPH_TOKENS 0) and as a graph replay
# (512: steps of up to 512 tokens replay graphs, the engine's default). Each step prints its wall, GPU and host
# launch time, then a cProfile table of its host side.
#   bash bench/device/mixed_step.sh              # PREFILLS (1x64 2x224) x GRAPH_TOKENS (0 512): four steps, ~8 min
# ROWS (25): cProfile rows. ARGS: more bench.engine.mixed_step flags (ARGS="--decode 128 --distinct 0 --compile
# --kernels": the base model's 128 decode rows through the compiled decoder, with a table of the step's kernels).
# WHEELS: .whl (the engine's config needs pydantic).
# Result: bench/results/<slug>-mixed-step.log, one "### command" section per step, copied to $OUT.
source bench/device/setup.sh
log=bench/results/$SLUG-mixed-step.log
: > "$log"
for prefill in ${PREFILLS:-1x64 2x224}; do
  for tokens in ${GRAPH_TOKENS:-0 512}; do
    cmd="python3 -m bench.engine.mixed_step --prefill $prefill --max-graph-tokens $tokens --rows ${ROWS:-25} ${ARGS:-}"
    echo "### $cmd (commit ${LORA_GIT_COMMIT:-unknown})" >> "$log"
    timeout ${STEP_S:-150} $cmd 2>&1 | quiet | tee -a "$log" | grep '^mixed step'
  done
done
bring_back mixed_step "$log"
