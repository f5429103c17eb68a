#!/usr/bin/env bash
# Launch ringserve on a single TPU host (all local chips through the `tp` mesh axis).
#   tools/launch_tpu.sh [MODEL] [extra ringserve flags...]
# Installs jax[tpu] into .venv on first use, then serves MODEL with bf16 weights/KV and one
# tensor-parallel shard per local chip.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL="${1:-smollm2}"; shift || true
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q -e . 'jax[tpu]'
CHIPS=$(.venv/bin/python -c 'import jax; print(jax.local_device_count())')
echo "TPU host: ${CHIPS} chips"
exec .venv/bin/ringserve generate --model "$MODEL" --dtype bfloat16 --tp-size "$CHIPS" "$@"
