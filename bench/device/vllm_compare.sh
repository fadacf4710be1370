#!/usr/bin/env bash
# Ours against vLLM 0.26.0 on the offline throughput workload, in one call on one GPU: 256 requests with S-LoRA
# lengths (prompt and output U[8, 512)), Llama-3-8B shapes in bf16, greedy, EOS ignored, the same seeded token-id
# requests and warm-up for both (bench/engine/offline_workload.py). For each max concurrent sequences in CONCURRENCY
# (32 128) and adapter count in ADAPTERS (0: the base model; 32: random rank-16 adapters on all seven targets), ours
# (bench.engine.throughput, 32 slots), then vLLM (bench.peers.vllm: max_num_seqs = the concurrency; with adapters
# enable_lora, max_loras 32, max_cpu_loras 32, max_lora_rank 16; gpu_memory_utilization 0.85; its defaults
# otherwise), each configuration in a process of its own: vLLM holds the GPU until its process exits.
#
# vLLM travels in chunks first (../shared/peers/vllm/README.md): one run of `bash .vstage/stage.sh` per chunk, carry
# [".vstage/c01", ".vstage/stage.sh"], then c02 and on, back to back on one warm machine. A chunk and the tree must
# fit the 64 MiB a call carries (in .vstage, `cat c?? > /tmp/p.tar && rm c?? && split -b 50M -d
# --numeric-suffixes=1 -a 2 /tmp/p.tar c` re-cuts them). Then, on that machine, two calls:
#   command: CONCURRENCY=32 LORA_GIT_COMMIT=<git rev-parse --short HEAD> bash bench/device/vllm_compare.sh
#   carry:   [".vstage/payload.sha256", ".vstage/install.sh", ".vstage/stage.sh"] (and "demo/whl-ct" for FP8)
#   then the same with CONCURRENCY=128.
# Ours needs no Ray, so no .whl: the pydantic its config needs comes with vLLM's install in /tmp/vsite.
# Time (estimated): the first call on a machine installs vLLM (~0.5 min) and builds the 16 GB base and 32 adapters
# under demo/ (~1.5 min), both kept for later calls; then each configuration takes ours ~0.5-1 min and vLLM
# ~1.5-2.5 min (LLM() starts in 50-80 s; 32 adapters at concurrency 32 run ~55 s). CONCURRENCY=32 on a fresh machine
# ~8 min, CONCURRENCY=128 after it ~5 min: the whole grid does not fit in one call's 10 minutes. COMPARE_S (575)
# bounds the call: no run starts with less than OURS_MIN_S (60) or VLLM_MIN_S (120) left, and ours' timed run ends
# by the limit (flagged partial).
# Also: SIZE (llama3-8b-shape, a demo size of app/demo/build.py), REQUESTS (256), ENGINE_ARGS (ours' EngineConfig
# fields, FIELD=VALUE each), VARIANTS (ours once per '|'-separated set of further fields, each result named after
# its set: VARIANTS="|overlap_steps=false" runs the defaults, then -overlap-steps-false; the summary counts the
# last), VLLM_ADAPTERS (the adapter counts vLLM runs too; ADAPTERS), VLLM_ARGS (further LLM(...) keywords, KEY=VALUE
# each), NAME_TAG (a suffix of both engines' result names: NAME_TAG=-fp8 ENGINE_ARGS=quantization=fp8
# VLLM_ARGS=quantization=fp8 compares FP8 bases), NOTE (kept in the results), CT_WHEELS (demo/whl-ct: the wheels of
# compressed-tensors and loguru, which vLLM's quantization code imports and its payload lacks; installed beside vLLM
# when the folder is carried. Here: pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation
# cp --platform manylinux_2_28_x86_64 --platform any -d demo/whl-ct compressed-tensors loguru).
# Results: bench/results/<slug>-throughput-{ours,vllm}-c<concurrency>-a<adapters>.json and this call's table,
# <slug>-throughput-vs-vllm.json, copied to $OUT (one tgz past 8 files) with vllm_compare.log (all output). Once
# both calls' results are in bench/results here, `python -m bench.peers.compare <those files> --out-dir <dir>` makes
# one table of all four rows.
WHEELS=${WHEELS-}  # setup.sh installs .whl unless told otherwise: not needed here
source bench/device/setup.sh
deadline=$(( SECONDS + ${COMPARE_S:-575} ))
log=$OUT/vllm_compare.log
bash .vstage/install.sh 2>&1 | tee -a "$log" | tail -2
[ "${PIPESTATUS[0]}" = 0 ] || { echo "vLLM is not installed: stage its chunks first (header)"; exit 1; }
ct_wheels=${CT_WHEELS:-demo/whl-ct}
if [ -d "$ct_wheels" ] && ! PYTHONPATH=/tmp/vsite python3 -c "import compressed_tensors" 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite "$ct_wheels"/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/vsite:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

common=(--size "${SIZE:-llama3-8b-shape}" --requests "${REQUESTS:-256}" --max-len 512 --dtype bfloat16 --slots 32)
[ -n "${NOTE:-}" ] && common+=(--note "$NOTE")

timed() {  # timed NAME MIN_S COMMAND...: COMMAND within what is left of COMPARE_S, if at least MIN_S is
  local name=$1 min=$2 left=$(( deadline - SECONDS )) start=$SECONDS status
  shift 2
  if [ "$left" -lt "$min" ]; then echo "== $name: skipped, $left s left (needs $min)" | tee -a "$log"; return; fi
  timeout "$left" "$@" > "$log.part" 2>&1
  status=$?
  { echo "== $name"; cat "$log.part"; } >> "$log"
  if [ "$status" = 0 ]; then quiet < "$log.part" | tail -3; else tail -15 "$log.part"; fi
  echo "== $name: exit $status after $(( SECONDS - start )) s (limit $left s)" | tee -a "$log"
  rm -f "$log.part"
}

for c in ${CONCURRENCY:-32 128}; do
  for a in ${ADAPTERS:-0 32}; do
    IFS='|' read -r -a variants <<< "${VARIANTS:-}"
    for variant in "${variants[@]:-}"; do
      tag=${variant:+-${variant//[^a-z0-9]/-}}
      ours=(--engine ours --adapters "$a" --max-batch-size "$c"
            --out "bench/results/$SLUG-throughput-ours-c$c-a$a${NAME_TAG:-}$tag.json")
      for field in ${ENGINE_ARGS:-} $variant; do ours+=(--engine-arg "$field"); done
      stop_by=$(( $(date +%s) + deadline - SECONDS - 10 ))  # ours' timed run ends before the call's limit
      timed "ours c$c a$a ${variant:-}" "${OURS_MIN_S:-60}" python3 -m bench.engine.throughput "${common[@]}" \
        "${ours[@]}" --stop-by "$stop_by"
    done
    [[ " ${VLLM_ADAPTERS-${ADAPTERS:-0 32}} " == *" $a "* ]] || continue
    vllm=(--adapters "$a" --max-batch-size "$c" --gpu-memory-utilization 0.85 --name "throughput-vllm-c$c-a$a${NAME_TAG:-}")
    for item in ${VLLM_ARGS:-}; do vllm+=(--engine-arg "$item"); done
    timed "vllm c$c a$a" "${VLLM_MIN_S:-120}" python3 -m bench.peers.vllm "${common[@]}" "${vllm[@]}"
  done
done

results=$(written "$SLUG-throughput-*-c*-a*.json")
[ -n "$results" ] && python3 -m bench.peers.compare $results 2>&1 | tee -a "$log"
bring_back vllm_compare $(written "$SLUG-throughput-*")
