#!/usr/bin/env bash
# The kernels against the HBM read floor measured in the same run, at Llama-3-8B shapes with 32 layers in one CUDA
# graph: paged GQA decode attention (bench.kernel.attention, beside SDPA on contiguous K/V) and the segmented LoRA
# shrink and expand over 7 targets (bench.kernel.lora). KERNELS=grammar also times the structured-output grammar
# libraries (bench.kernel.grammar) on the machine's host CPU; it needs them (xgrammar, llguidance, outlines-core)
# in WHEELS.
#   bash bench/device/kernels.sh                     # attention, then LoRA (~3 min)
#   SWEEP=1 bash bench/device/kernels.sh             # also other split counts and tile configs per case
#   KERNELS=fp8 bash bench/device/kernels.sh         # the base GEMMs in FP8 against bf16 (bench.kernel.fp8)
#   KERNELS=lora_prefill bash bench/device/kernels.sh  # a prefill step's LoRA three ways (bench.kernel.lora_prefill)
#   KERNELS=grammar WHEELS=.whl-grammar bash bench/device/kernels.sh
# KERNEL_S (280 s each). Results: bench/results/<slug>-attention-kernels.json, <slug>-lora-kernels.json,
# <slug>-fp8-gemm.json, <slug>-lora-prefill.json, <slug>-grammar-libs.json, copied to $OUT.
source bench/device/setup.sh
sweep=(); [ "${SWEEP:-0}" = 1 ] && sweep=(--sweep)
files=()
for kernel in ${KERNELS:-attention lora}; do
  case $kernel in
  attention) timeout "${KERNEL_S:-280}" python3 -m bench.kernel.attention "${sweep[@]}" 2>&1 | quiet | grep -v '"sweep_'
             files+=("bench/results/$SLUG-attention-kernels.json") ;;
  lora) timeout "${KERNEL_S:-280}" python3 -m bench.kernel.lora "${sweep[@]}" 2>&1 | quiet | grep '"default": true'
        files+=("bench/results/$SLUG-lora-kernels.json") ;;
  fp8) timeout "${KERNEL_S:-280}" python3 -m bench.kernel.fp8 2>&1 | quiet
       files+=("bench/results/$SLUG-fp8-gemm.json") ;;
  lora_prefill) timeout "${KERNEL_S:-280}" python3 -m bench.kernel.lora_prefill 2>&1 | quiet
                files+=("bench/results/$SLUG-lora-prefill.json") ;;
  grammar) timeout "${KERNEL_S:-280}" python3 -m bench.kernel.grammar 2>&1 | quiet | tail -12
           files+=("bench/results/$SLUG-grammar-libs.json") ;;
  *) echo "unknown kernel $kernel (attention, lora, fp8, lora_prefill, grammar)"; exit 2 ;;
  esac
done
bring_back kernels "${files[@]}"
