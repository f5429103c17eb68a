#!/usr/bin/env bash
# The GPU checks of a session that is lent a GPU machine (the `device` tool: one H200, CUDA JAX,
# torch and transformers installed, nothing reachable): the step benchmark before and after a
# change, and the serving benchmark at bf16, in one call that fits the lease.
#
#   tools/gpu_check.sh prepare [BEFORE]    here: the wheels the GPU image lacks (cp312) into .whl/,
#                                          the tree of commit BEFORE (default HEAD) into .gpu/before,
#                                          SmolLM2's config and tokenizer into .gpu/tok
#   bash tools/gpu_check.sh run            there, from the repository root, carrying .whl and .gpu:
#                                          writes sf_after, sf_before, sf_pallas_gpu, sf_int8,
#                                          serve_after, serve_before (.txt, and .json) under $OUT
#
# The model is SmolLM2-135M's shape with random weights (model/checkpoints/random_shapes.py, made
# there) and its real config and tokenizer: the weights (540 MB) do not fit the 64 MiB a call
# carries, and a step costs the same whatever the weights. Each stage has its own deadline, so
# the call returns what it finished; each serving stage prints the engine's start-up: seconds to
# serving and to every program compiled, and the program count (2026-11-29: a server compiled 19 shapes x 4
# context buckets at context 4096 on a GPU, minutes; the serving stages use context 1024).
set -uo pipefail

WHEELS="msgspec posix_ipc llguidance gguf fastapi starlette pydantic pydantic_core annotated-types typing-inspection opentelemetry-api"
TAGS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 --platform any"

prepare() {
  local before=${1:-HEAD} py=${PYTHON:-.venv/bin/python} model=${RINGSERVE_CACHE:-$HOME/.cache/ringserve}/smollm2-135m-instruct
  mkdir -p .git/info
  for p in /.whl/ /.gpu/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
  rm -rf .whl .gpu && mkdir -p .whl .gpu/before .gpu/tok
  for w in $WHEELS; do  # the versions this checkout's venv runs
    v=$("$py" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$w") || exit 1
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $TAGS -d .whl "$w==$v" || exit 1
  done
  # (the tree's own parts: `ringserve/` from the package's rename on)
  git archive "$before" $(git ls-tree --name-only "$before" | grep -xE 'ringserve|actors|kvmem|model|bench|tools|pyproject.toml') \
    | tar -x -C .gpu/before || exit 1
  cp "$model"/{config.json,tokenizer.json,tokenizer_config.json} .gpu/tok/ || { echo "fetch SmolLM2 first: ringserve fetch-model smollm2"; exit 1; }
  git rev-parse "$before" > .gpu/before/COMMIT
  du -sh .whl .gpu
}

run() {
  local t0 out=${OUT:-/tmp/gpu-out} root
  t0=$(date +%s) root=$(pwd)
  mkdir -p "$out"
  left() { echo $(($1 - ($(date +%s) - t0))); }  # seconds until a stage's deadline
  stage() {  # stage NAME DEADLINE_S DIR COMMAND...: tee'd to $out/NAME.txt, killed at the deadline
    local name=$1 limit dir=$3
    limit=$(left "$2"); shift 3
    if [ "$limit" -lt 30 ]; then echo "== $name skipped: ${limit} s left"; return; fi
    echo "== $name (at $(($(date +%s) - t0)) s, up to $limit s)"
    (cd "$dir" && PYTHONPATH=.:/tmp/site timeout "$limit" "$@" 2>&1 | grep -v Warning | tee "$out/$name.txt")
  }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
  nvidia-smi -L
  PYTHONPATH=/tmp/site python3 -c "import jax, flax, transformers, torch; print(jax.__version__, flax.__version__, transformers.__version__, torch.__version__, jax.devices())"
  local smol=/tmp/smol rnd
  rnd=$(PYTHONPATH=.:/tmp/site python3 -c "from ringserve.model.checkpoints.random_shapes import random_model; print(random_model('smollm2-135m'))") || exit 4
  mkdir -p $smol && cp .gpu/tok/* $smol/ && ln -sf "$rnd/model.safetensors" $smol/model.safetensors
  local before=$root/.gpu/before
  bench() { if [ -f "$1/ringserve/__init__.py" ]; then echo "ringserve.bench.$2"; else echo "bench.$2"; fi; }  # a tree before the rename
  sf() { echo "python3 -m $(bench "$1" step_floor) --model smollm2-135m --dtype bfloat16"; }
  serve() { echo "python3 -m $(bench "$1" serving) --model $smol --dtype bfloat16 --num-prompts 64 --context-length 1024 --disable-tqdm"; }
  echo "before: $(cat "$before/COMMIT")"
  # shellcheck disable=SC2046
  stage sf_after 120 "$root" $(sf "$root")
  # shellcheck disable=SC2046
  stage sf_before 190 "$before" $(sf "$before") --no-hf
  # shellcheck disable=SC2046
  stage sf_pallas_gpu 240 "$root" $(sf "$root") --no-hf --backend pallas_gpu
  # shellcheck disable=SC2046
  stage sf_int8 290 "$root" $(sf "$root") --no-hf --quantization int8
  # shellcheck disable=SC2046
  stage serve_after 430 "$root" $(serve "$root") --output-json "$out/serve_after.json"
  # shellcheck disable=SC2046
  stage serve_before 560 "$before" $(serve "$before") --output-json "$out/serve_before.json"
  echo "== done at $(($(date +%s) - t0)) s"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) run ;;
  *) echo "usage: tools/gpu_check.sh prepare [BEFORE] | run" >&2; exit 2 ;;
esac
