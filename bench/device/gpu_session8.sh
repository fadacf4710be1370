#!/usr/bin/env bash
# Device calls of session 8 (1 x H100). Set LORA_GIT_COMMIT first: the device copy has no .git.
#   PART=overhead WHEELS=.whl-serve bash bench/device/gpu_session8.sh  # Serve's TTFT overhead through HAProxy (as
#       `make serve` runs it); then, where .gl/tracefiles holds copies of the serving files with per-hop
#       timestamps (ad hoc, never committed), the same requests once more, timed hop by hop
#       (ENGINE_PROCESS=1: also with the engine loop in its own process)
#   PART=tests WHEELS=.whl bash bench/device/gpu_session8.sh  # the GPU tests
source bench/device/setup.sh
case "${PART:-overhead}" in
overhead)
  for app in '{"engine_process": false}' ${ENGINE_PROCESS:+'{"engine_process": true}'}; do
    timeout ${OVERHEAD_S:-240} python3 -m bench.serve_overhead --size tiny --requests ${REQUESTS:-100} \
      --app-args "$app" 2>&1 | quiet | tee -a "$OUT/serve-overhead.log" | grep -E "^\{|wrote"
    ray stop --force >/dev/null 2>&1
  done
  cp bench/results/*serve-overhead*haproxy*.json "$OUT/" 2>/dev/null
  if [ -d .gl/tracefiles ]; then
    rm -rf /tmp/tr && mkdir /tmp/tr && cp -r app deploy bench prefetch demo pyproject.toml /tmp/tr/ 2>/dev/null
    cp -r .gl/tracefiles/* /tmp/tr/
    (cd /tmp/tr && PYTHONPATH=/tmp/site:/tmp/tr timeout 200 python3 trace_client.py 2>&1 | quiet | tail -14) \
      | tee "$OUT/serve-overhead-hops.log"
    ray stop --force >/dev/null 2>&1
  fi ;;
tests)
  timeout ${TEST_S:-400} python3 -m pytest -q -rs -m gpu tests/app -p no:cacheprovider 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.log" ;;
esac
