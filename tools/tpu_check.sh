#!/usr/bin/env bash
# The one call a TPU host runs, the day one is lent: what `ringserve compile` only estimates
# here, measured. From the repository root, with ringserve installed (README command 1, with
# `jax[tpu]` on the host) and two checkpoints on local disk (ringserve never downloads weights):
#
#   LLAMA31_8B=/models/Llama-3.1-8B-Instruct QWEN3_8B=/models/Qwen3-8B tools/tpu_check.sh [OUT]
#
# Writes under OUT (default ./tpu-check-<date>): the chips and versions; `ringserve compile`'s
# report for the launcher's flags on this host's topology (compiled against libtpu, as CI does)
# and the start-up (program count, seconds) of a real server; the step floor (bench.step_floor,
# SmolLM2's shape); and the serving benchmark (`ringserve bench`, the engine backend, random
# prompts of fixed lengths) at the published workloads:
#   tpu-inference  Llama-3.1-8B, one v6e, 1,800 in / 128 out        its CI floor: >= 10.77 req/s
#   sglang-jax     Qwen3-8B, v6e-4 (tp 4), 1k in / 1k out, batch 64  5,297 tok/s; batch 256 7,572
# Each stage has a deadline (STAGE_S, default 1200 s) and the next runs whatever the last did.
set -uo pipefail

out=${1:-tpu-check-$(date +%Y%m%d-%H%M)}
stage_s=${STAGE_S:-1200}
bin=${RINGSERVE_BIN:-$(command -v ringserve || true)}
[ -n "$bin" ] || { echo "tpu_check.sh: no ringserve on PATH (install it first, or set RINGSERVE_BIN)" >&2; exit 2; }
py="$(dirname "$bin")/python"
[ -x "$py" ] || py=python3
mkdir -p "$out"
export JAX_PLATFORMS=tpu XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

stage() {  # stage NAME COMMAND...: tee'd to $out/NAME.txt, killed at the deadline
  local name=$1; shift
  echo "== $name ($(date +%T), up to ${stage_s} s): $*"
  timeout "$stage_s" "$@" 2>&1 | tee "$out/$name.txt"
}

read -r chips kind < <("$py" -c 'import jax; d = jax.devices(); print(len(d), d[0].device_kind.replace(" ", "_"))') || {
  echo "tpu_check.sh: JAX sees no TPU here" >&2; exit 2; }
"$py" -c 'import jax, jaxlib, flax; print(jax.__version__, jaxlib.__version__, flax.__version__, jax.devices())' | tee "$out/versions.txt"
echo "chips: $chips x $kind" | tee -a "$out/versions.txt"
tp_qwen=$(( chips >= 4 ? 4 : chips ))

# 1. the launcher's programs, compiled ahead of time (libtpu is the host's own here)
stage compile_launcher tools/launch_tpu.sh --dry-run --model "${LLAMA31_8B:-llama-3-8b}"

# 2. the step floor: one step of each shape against its bytes-read floor
stage step_floor "$py" -m ringserve.bench.step_floor --model smollm2-135m --dtype bfloat16 --backend pallas --no-hf

# 3. tpu-inference's workload: Llama-3.1-8B on one chip, 1,800 in / 128 out
if [ -n "${LLAMA31_8B:-}" ]; then
  stage serve_llama31_8b_1800_128 "$bin" bench --model "$LLAMA31_8B" --backend engine --dtype bfloat16 \
    --attention-backend pallas --page-size 64 --tp-size 1 --num-prompts 512 --input-len 1800 1800 --output-len 128 128 \
    --max-running-requests 256 --context-length 2048 --disable-tqdm --output-json "$out/serve_llama31_8b_1800_128.json"
else
  echo "== serve_llama31_8b skipped: set LLAMA31_8B to a local Llama-3.1-8B(-Instruct) directory"
fi

# 4. sglang-jax's workload: Qwen3-8B at tp 4, 1k / 1k, batch 64 and 256
if [ -n "${QWEN3_8B:-}" ]; then
  for batch in 64 256; do
    stage "serve_qwen3_8b_1k_1k_b$batch" "$bin" bench --model "$QWEN3_8B" --backend engine --dtype bfloat16 \
      --attention-backend pallas --page-size 64 --tp-size "$tp_qwen" --num-prompts $((batch * 4)) \
      --input-len 1024 1024 --output-len 1024 1024 --max-concurrency "$batch" --max-running-requests "$batch" \
      --context-length 2048 --disable-tqdm --output-json "$out/serve_qwen3_8b_1k_1k_b$batch.json"
  done
else
  echo "== serve_qwen3_8b skipped: set QWEN3_8B to a local Qwen3-8B directory"
fi
echo "== done: $out"
