#!/usr/bin/env bash
# Session 10, one device call (1 x H100; Ray from the wheelhouse in WHEELS: .whl-serve has HAProxy): streaming
# through Serve under HTTP load (Llama-3-8B shapes, 1 replica, 256 requests of 128 tokens, 64 at once,
# compile_decode off for a shorter start-up unless a run says compile): output tokens/s, TTFT, chunk gaps and the
# replica's step timing, once per entry of RUNS, each LOOP:INTERVAL_MS[:FLAG...]: LOOP is process (the engine in
# its own process, the app's default on a GPU since session 11) or thread (on a thread of the replica), INTERVAL_MS the replica's
# stream_interval_ms; FLAG proxy sends HTTP through Serve's Python proxy instead of HAProxy, FLAG compile turns
# compile_decode on (the default of the app; ~1 min more start-up). Set LORA_GIT_COMMIT.
#   RUNS="process:0 process:20 process:50" WHEELS=.whl-serve bash bench/device/gpu_session10.sh
#   RUNS="process:0 process:0:compile" ...  # compile_decode under Serve load, both ways in one call (~6 min)
set -uo pipefail
source bench/device/setup.sh
for run in ${RUNS:-process:0 process:20 process:50}; do
  IFS=: read -r loop ms flags <<<"$run"
  process=$([ "$loop" = process ] && echo true || echo false)
  extra=(); tag="-engine-$loop-stream${ms}ms"; compile=false
  [[ ":${flags:-}:" == *:proxy:* ]] && extra=(--serve-proxy) && tag+="-serve-proxy"
  [[ ":${flags:-}:" == *:compile:* ]] && compile=true && tag+="-compiled"
  echo "== serve under HTTP load (llama3-8b-shape, 1 replica, engine $loop, stream_interval_ms $ms, ${flags:-haproxy})"
  timeout ${SERVE_S:-180} python3 -m bench.serve_bench --launch --size llama3-8b-shape --adapters 32 --slots 32 \
    --batch 32 --num-requests ${REQUESTS:-256} --max-tokens 128 --prompt-words 64 --max-concurrency 64 "${extra[@]}" \
    --app-args "{\"engine_process\": $process, \"compile_decode\": $compile, \"stream_interval_ms\": $ms}" \
    --tag="$tag" 2>&1 | grep -vE "^\s*$|INFO|WARN|it/s\]|warn|logging.cc:474:     @" | tail -40 \
    | tee "$OUT/serve$tag.log"
  ray stop --force >/dev/null 2>&1
done
cp bench/results/*serve-uniform-llama3-8b-shape-engine-*-stream*.json "$OUT/" 2>/dev/null
ls "$OUT"
