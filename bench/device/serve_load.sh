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
# PART=scaling, 2 or 4 GPUs: Llama-3-8B shapes, first one engine's offline throughput (bench/device/throughput.sh at
# BATCH, over ADAPTERS: the ceiling one replica cannot pass), then REPLICAS (1 2, and 4 on four GPUs) replicas of a GPU
# each behind ROUTERS (adapter_affinity), REQUESTS streams of 128 tokens (64-word prompts) sent at once, uniform
# over ADAPTERS (32) in 32 slots, at most 8 × BATCH (32) × the largest replica count in flight.
#   PART=scaling bash bench/device/serve_load.sh                       # ~2 min a replica count, plus ~2 min
#   PART=scaling ROUTERS=serve_default REPLICAS="2 4" OFFLINE=0 bash bench/device/serve_load.sh
# REQUESTS (256; 400 for PART=replicas; 1024 for PART=scaling), SERVE_S (the time limit of one run, 180 s; 420 s for
# PART=replicas; 540 s for PART=scaling).
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
scaling)
  [ "$GPUS" -lt 2 ] && echo "PART=scaling compares replicas of a GPU each: it needs 2 GPUs or more, not $GPUS" && exit 2
  batch=${BATCH:-32} adapters=${ADAPTERS:-32}
  replicas=${REPLICAS:-1 2 $([ "$GPUS" -ge 4 ] && echo 4)}
  if [ "${OFFLINE:-1}" != 0 ]; then
    BATCH=$batch ADAPTERS=$adapters TAG=-c$batch-a$adapters-scaling-ceiling THROUGHPUT_S=200 \
      bash bench/device/throughput.sh 2>&1 | grep -E "tok/s|wrote|rror"
  fi
  most=$(echo $replicas | tr ' ' '\n' | sort -n | tail -1)
  timeout "${SERVE_S:-540}" python3 -m bench.serve.load --launch --replicas $replicas \
    --router ${ROUTERS:-adapter_affinity} --size llama3-8b-shape --adapters "$adapters" --slots 32 --batch "$batch" \
    --num-requests "${REQUESTS:-1024}" --rate 0 --max-tokens 128 --prompt-words 64 \
    --max-concurrency $((8 * batch * most)) --workload uniform \
    --tag="${TAG:--scaling-a$adapters}" 2>&1 | grep -vE "^\s*$|requests:|INFO|WARN|it/s\]" | tail -60
  ray stop --force >/dev/null 2>&1
  bring_back serve_load $(written "$SLUG-serve-uniform-llama3-8b-shape*.json") $(written "$SLUG-throughput-*.json") ;;
*) echo "PART is engine, replicas or scaling, not ${PART}"; exit 2 ;;
esac
