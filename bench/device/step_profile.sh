#!/usr/bin/env bash
# Where one engine decode step's time goes (bench.engine.step_profile): the wall time of engine.step(), the model
# forward inside it, and a cProfile table of the step's Python, for base rows and rows on distinct adapters.
#   bash bench/device/step_profile.sh            # Llama-3-8B shapes, batches 1 4 16 32 (BATCHES), 16 steps each
# SLOTS (8), STEPS (16), CONTEXT (64). WHEELS: .whl (the engine's config needs pydantic).
# A fresh machine builds the 16 GB base first, inside PROFILE_S (560). Result:
# bench/results/<slug>-step-profile-llama3-8b-shape.json, copied to $OUT only where this call wrote it.
source bench/device/setup.sh
timeout "${PROFILE_S:-560}" python3 -m bench.engine.step_profile --size llama3-8b-shape --batches ${BATCHES:-1 4 16 32} \
  --slots "${SLOTS:-8}" --steps "${STEPS:-16}" --context "${CONTEXT:-64}" 2>&1 | quiet | tail -40
bring_back step_profile $(written "$SLUG-step-profile-llama3-8b-shape.json")  # none where the run did not finish
