#!/usr/bin/env bash
# The GPU tests (pytest -m gpu; they skip without CUDA): the Triton attention and LoRA kernels against their
# references, also replayed in CUDA graphs; varlen prefill; graph replay, compiled or not, against eager and PEFT;
# bf16 fidelity and churn; copy/compute overlap; overlapped steps; FP8; sharded engines at 2 and 4 GPUs where the
# host has them. About 4-6 minutes on one H100 or four H200s, 9 on one H200 with PER_FILE.
#   LORA_GIT_COMMIT=$(git rev-parse --short HEAD) bash bench/device/gpu_tests.sh     # carry .whl
# WHEELS (.whl: the tests import pydantic and FastAPI), TESTS (tests/app tests/prefetch), TEST_S (570 s; one H200
# took about 550 s for the whole suite with PER_FILE).
# PER_FILE=1 runs each test file in a process of its own (about a minute more): a CUDA fault, which poisons the
# process that meets it, then fails that file alone, and the log names it with the fault's own report.
# Log: bench/results/<slug>-gpu-tests.log (its first line: the commit and the command), copied to $OUT.
WHEELS=${WHEELS-.whl}
source bench/device/setup.sh
log=bench/results/$SLUG-gpu-tests.log
tests=${TESTS:-tests/app tests/prefetch}
echo "# commit ${LORA_GIT_COMMIT:-unknown}: python3 -m pytest -q -rs -m gpu $tests${PER_FILE:+ (one process a file)}" \
  > "$log"
# The log keeps pytest's whole report (every failure's text); the call shows its end.
if [ -z "${PER_FILE:-}" ]; then
  timeout "${TEST_S:-570}" python3 -m pytest -q -rs -m gpu $tests -p no:cacheprovider >> "$log" 2>&1
else
  deadline=$(( SECONDS + ${TEST_S:-570} ))
  files=$(python3 -m pytest -q --collect-only -m gpu $tests -p no:cacheprovider 2>/dev/null | grep '::' \
    | cut -d: -f1 | uniq)
  for f in $files; do
    left=$(( deadline - SECONDS ))
    [ "$left" -gt 0 ] || { echo "== $f: not run, no time left" >> "$log"; continue; }
    echo "== $f" >> "$log"
    timeout "$left" python3 -m pytest -q -rs -m gpu "$f" -p no:cacheprovider >> "$log" 2>&1
    echo "== $f: exit $?" | tee -a "$log"
  done
fi
tail -30 "$log"
bring_back gpu_tests "$log"
