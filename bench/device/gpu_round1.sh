#!/usr/bin/env bash
# One device call: GPU tests, the decode-step benchmark on Llama-3-8B shapes, and the Serve app on one GPU.
# Run from the repo root on the device with .whl carried (see ../shared/device/make-wheelhouse.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" | tee -a "$OUT/gpu.txt"
timeout 120 python3 -m app.demo --out demo/tiny 2>&1 | tail -1
echo "== gpu tests"; timeout 300 python3 -m pytest -q -rs -s -m gpu tests/app/test_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
echo "== forward bench"; timeout 400 python3 -m bench.forward_bench --size llama3-8b-shape --batch 32 --context 512 2>&1 | grep -v Warning | tee "$OUT/forward.log" | tail -14
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
  echo "== serve smoke (1 GPU replica)"
  timeout 300 python3 -m bench.serve_smoke --replicas 1 --requests 96 --concurrency 32 2>&1 | grep -E "^\{|wrote|Error|error" | tail -5
fi
cp bench/results/*.json "$OUT/" 2>/dev/null
ls "$OUT"
