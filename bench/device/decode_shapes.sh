#!/usr/bin/env bash
# The decode step at three models' shapes, each against its own weight-read floor, in one call on one machine
# (bench.engine.decode --shape, one process per shape): Llama-3-8B, Qwen2.5-7B and Gemma-2-9B in bf16, random
# weights and 64 rank-16 all-linear adapters built on the GPU, compiled CUDA graphs, batch 1 and 32 at context 512
# (inside Gemma 2's 4096-token window, so its sliding layers attend to every token, as its full ones do), 2 runs of
# 20 replays each; prefill 8 x 512 and an eager batch-32 step as decode.sh runs them. Each process measures the HBM
# read rate of its floor itself.
#   bash bench/device/decode_shapes.sh           # ~4-6 min: each shape 1-2.5 min, mostly compiling and capturing
# SHAPES (llama-3-8b qwen2.5-7b gemma-2-9b), BATCHES (1 32), RUNS (2), ITERS (20), ARGS (more bench.engine.decode
# flags), TAG (a suffix of the results' names), DECODE_S (545: the whole call's limit), SHAPE_S (160) and GEMMA_S
# (230): one shape's limit, cut to what is left of DECODE_S. WHEELS: .whl (the engine's config needs pydantic).
# Results: bench/results/<slug>-decode-shapes-<shape><TAG>.json per shape and <slug>-decode-shapes<TAG>.log (every
# shape's JSON lines), copied to $OUT; then a summary: each decode step's ratio to its floor, and to Llama-3-8B's
# ratio at the same batch and adapters.
source bench/device/setup.sh
deadline=$(( SECONDS + ${DECODE_S:-545} ))
log=bench/results/$SLUG-decode-shapes${TAG:-}.log
: > "$log"
results=()
for shape in ${SHAPES:-llama-3-8b qwen2.5-7b gemma-2-9b}; do
  limit=${SHAPE_S:-160}; [ "$shape" = gemma-2-9b ] && limit=${GEMMA_S:-230}
  left=$(( deadline - SECONDS )); [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 60 ]; then echo "== $shape: skipped, $left s left" | tee -a "$log"; continue; fi
  out=bench/results/$SLUG-decode-shapes-$shape${TAG:-}.json
  start=$SECONDS
  timeout "$limit" python3 -m bench.engine.decode --shape "$shape" --compile --runs "${RUNS:-2}" \
    --iters "${ITERS:-20}" --batches ${BATCHES:-1 32} ${ARGS:-} --out "$out" 2>&1 | quiet > "$log.part"
  status=${PIPESTATUS[0]}
  cat "$log.part" >> "$log"
  echo "== $shape: exit $status after $(( SECONDS - start )) s (limit $limit s)" | tee -a "$log"
  [ "$status" = 0 ] || tail -15 "$log.part"
  results+=("$out")
done
rm -f "$log.part"
python3 - "${results[@]}" <<'PY'
import json
import sys

runs = {}
for path in sys.argv[1:]:
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        continue
    runs[record["shape"]] = record["results"]
llama = {(r["batch"], r["distinct"]): r["ratio_to_floor"]
         for r in runs.get("llama-3-8b", []) if r["variant"] == "decode"}
for shape, lines in runs.items():
    floor = next(r for r in lines if r["variant"] == "floor")
    print(f"{shape}: {floor['weights_gb']} GB of weights, floor {floor['floor_ms']} ms at {floor['hbm_read_gbs']} "
          f"GB/s; head_dim {floor['head_dim']}, {floor['layers']} layers, graphs {floor['buckets']} captured in "
          f"{floor['graph_capture_s']} s")
    for r in lines:
        if r["variant"] != "decode":
            continue
        text = (f"  batch {r['batch']:>2}, {r['distinct']:>2} adapters: {r['ms']:.3f} ms = "
                f"{r['ratio_to_floor']:.3f}x floor")
        if (r["batch"], r["distinct"]) in llama:
            text += f" = {r['ratio_to_floor'] / llama[r['batch'], r['distinct']]:.3f}x Llama's ratio"
        text += f"; {r['ratio_to_floor_with_kv']:.3f}x floor + K/V ({r['kv_read_gb']} GB)"
        if "attention_ms" in r:
            text += (f"; attention alone {r['attention_ms']:.3f} ms = {r['attention_ratio_to_kv_floor']:.2f}x its K/V "
                     f"floor (error {r['attention_error']:.1e})")
        print(text)
PY
bring_back decode_shapes "$log" "${results[@]}"
