#!/usr/bin/env bash
# Offline engine throughput (bench.engine.throughput): 256 requests with S-LoRA lengths (prompt and output
# U[8, 512)) over 32 random rank-16 all-linear adapters, Llama-3-8B shapes in bf16, all submitted at once, every
# adapter resident before the clock starts; output tokens per second, and the engine's step timing.
#   bash bench/device/throughput.sh                  # this engine with its defaults (~2 min with the build)
#   ENGINE_ARGS="max_graph_tokens=0 max_prefill_tokens_per_step=2048" TAG=-mixed-steps-eager \
#     bash bench/device/throughput.sh                # any EngineConfig fields, FIELD=VALUE each
#   ENGINE=peft bash bench/device/throughput.sh      # PEFT's mixed-adapter generate in static batches of 32, stopped
#                                                    # after BUDGET_S (240) s: it finishes few requests in that time
# BATCH (32: max concurrent sequences), ADAPTERS (32; 0: the base model), NOTE (free text kept in the result),
# THROUGHPUT_S (the time limit), VERBOSE (1: the run's last 60 lines, log lines included, instead of its last 8
# results). WHEELS: .whl (the engine's config needs pydantic).
# Result: bench/results/<slug>-throughput<TAG>.json (TAG: none for this engine, -peft for PEFT), copied to $OUT.
source bench/device/setup.sh
engine=${ENGINE:-ours}
tag=${TAG-$([ "$engine" = peft ] && echo -peft)}
args=(--engine "$engine" --size llama3-8b-shape --requests 256 --adapters "${ADAPTERS:-32}"
      --max-batch-size "${BATCH:-32}" --max-len 512 --dtype bfloat16)
if [ "$engine" = peft ]; then args+=(--time-budget-s "${BUDGET_S:-240}"); else args+=(--slots 32); fi
for field in ${ENGINE_ARGS:-}; do args+=(--engine-arg "$field"); done
[ -n "${NOTE:-}" ] && args+=(--note "$NOTE")
out=bench/results/$SLUG-throughput$tag.json
if [ -n "${VERBOSE:-}" ]; then shown() { tr '\r' '\n' | tail -60; } else shown() { quiet | tail -8; } fi
timeout "${THROUGHPUT_S:-560}" python3 -m bench.engine.throughput "${args[@]}" --out "$out" 2>&1 | shown
bring_back throughput "$out"
