#!/usr/bin/env bash
# Where one engine decode step's time goes (bench.engine.step_profile): the wall time of engine.step(), the model
# forward inside it, and a cProfile table of the step's Python, for base rows and rows on distinct adapters.
#   bash bench/device/step_profile.sh            # Llama-3-8B shapes, batches 1 4 16 32 (BATCHES), 16 steps each
# SLOTS (8), STEPS (16), CONTEXT (64). WHEELS: .whl (the engine's config needs pydantic).
# Result: bench/results/<slug>-step-profile-llama3-8b-shape.json, copied to $OUT.
source bench/device/setup.sh
timeout "${PROFILE_S:-560}" python3 -m bench.engine.step_profile --size llama3-8b-shape --batches ${BATCHES:-1 4 16 32} \
  --slots "${SLOTS:-8}" --steps "${STEPS:-16}" --context "${CONTEXT:-64}" 2>&1 | quiet | tail -40
bring_back step_profile "bench/results/$SLUG-step-profile-llama3-8b-shape.json"
