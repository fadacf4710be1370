#!/usr/bin/env bash
# Serving under HTTP load (bench.serve.load --launch): streaming completions through Ray Serve, output tokens/s,
# TTFT, chunk gaps, and each replica's engine step timing (from /v1/debug/replicas). Ray from WHEELS (.whl-serve:
# HTTP through HAProxy, as `make serve`).
#
# PART=engine (the default), one GPU: Llama-3-8B shapes, 1 replica, 32 adapters in 32 slots, batch 32, 256
# streaming requests of 128 tokens (64-word prompts), 64 at once; once per entry of RUNS, LOOP:INTERVAL_MS[:FLAG...]:
# LOOP is process (the engine loop in its own process, the default on a GPU) or thread (a thread of the replica),
# INTERVAL_MS the replica's stream_interval_ms (0: a chunk per token); FLAG proxy sends HTTP through Serve's proxy
# instead of HAProxy, FLAG uncompiled turns compile_decode off (~1 min less start-up a run).
#   bash bench/device/serve_load.sh                                    # RUNS="process:0": the app's defaults (~4 min)
#   RUNS="process:0 process:0:uncompiled" bash bench/device/serve_load.sh       # compile_decode both ways (~7 min)
#   RUNS="process:0:uncompiled thread:0:uncompiled process:20:uncompiled" TAG=-stream-options \
#     bash bench/device/serve_load.sh                                  # engine loop and stream interval
# PART=replicas, two GPUs (nvidia-h200-x2): 1 and 2 replicas, each behind the adapter-affinity router and Serve's
# default router, SIZE (tiny) demo, 400 streaming requests of 64 tokens sent at once, uniform over the adapters.
#   PART=replicas bash bench/device/serve_load.sh
# REQUESTS (256; 400 for PART=replicas), SERVE_S (the time limit of one run, 180 s; 420 s for PART=replicas).
# Results: bench/results/<slug>-serve-uniform-<size><TAG>[-engine-<loop>-stream<ms>ms[-serve-proxy][-uncompiled]].json,
# copied to $OUT.
WHEELS=${WHEELS-.whl-serve}
source bench/device/setup.sh
case "${PART:-engine}" in
engine)
  for run in ${RUNS:-process:0}; do
    IFS=: read -r loop ms flags <<<"$run"
    process=$([ "$loop" = process ] && echo true || echo false)
    extra=(); tag="${TAG:-}-engine-$loop-stream${ms}ms"; compile=true
    [[ ":${flags:-}:" == *:proxy:* ]] && extra=(--serve-proxy) && tag+="-serve-proxy"
    [[ ":${flags:-}:" == *:uncompiled:* ]] && compile=false && tag+="-uncompiled"
    echo "== serve under HTTP load (llama3-8b-shape, 1 replica, engine $loop, stream_interval_ms $ms, ${flags:-haproxy})"
    timeout "${SERVE_S:-180}" python3 -m bench.serve.load --launch --size llama3-8b-shape --adapters 32 --slots 32 \
      --batch 32 --num-requests "${REQUESTS:-256}" --max-tokens 128 --prompt-words 64 --max-concurrency 64 \
      "${extra[@]}" --app-args "{\"engine_process\": $process, \"compile_decode\": $compile, \"stream_interval_ms\": $ms}" \
      --tag="$tag" 2>&1 | grep -vE "^\s*$|INFO|WARN|it/s\]|warn|logging.cc:474:     @" | tail -40
    ray stop --force >/dev/null 2>&1
  done
  bring_back serve_load $(written "$SLUG-serve-uniform-llama3-8b-shape*.json") ;;
replicas)
  size=${SIZE:-tiny}
  [ "$GPUS" -lt 2 ] && echo "PART=replicas compares 1 and 2 replicas, one GPU each: it needs 2 GPUs, not $GPUS" && exit 2
  [ "$size" = tiny ] && build_demo tiny
  size_args=(--slots 4); [ "$size" = llama3-8b-shape ] && size_args=(--adapters 32 --slots 32)
  timeout "${SERVE_S:-420}" python3 -m bench.serve.load --launch --replicas 1 2 --router adapter_affinity serve_default \
    --size "$size" "${size_args[@]}" --batch 32 --num-requests "${REQUESTS:-400}" --rate 0 --max-tokens 64 \
    --workload uniform --tag="${TAG:-}" 2>&1 | grep -vE "^\s*$|requests:|INFO|WARN" | tail -60
  ray stop --force >/dev/null 2>&1
  bring_back serve_load $(written "$SLUG-serve-uniform-$size*.json") ;;
*) echo "PART is engine or replicas, not ${PART}"; exit 2 ;;
esac
