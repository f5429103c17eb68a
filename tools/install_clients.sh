#!/usr/bin/env bash
# Install the RL frameworks that tests/clients/ drives ringserve with, each into its own venv
# under clients/ = $RINGSERVE_CACHE/clients/ (default ~/.cache/ringserve/clients/), never into
# ringserve's venv. Nothing here is needed by the README's two commands: tests/clients/ skips a
# framework that is absent, naming this script.
#
#   tools/install_clients.sh [tunix] [areal]        (no argument: both)
#
#   tunix   clients/tunix/   google-tunix (resolves with ringserve's jax and flax, no torch) and
#                            ringserve's own runtime dependencies: the tests run ringserve from
#                            the checkout in that venv (PYTHONPATH), in the trainer's process
#   areal   clients/areal/   areal (AReaL's RemoteSGLangEngine, a client of a running server):
#                            torch's CPU wheel first, then areal without its dependencies (its
#                            torch pin pulls the CUDA wheels, gigabytes) and what its client
#                            modules import
#
# Pinned versions below; CLIENTS_DIR moves the folder. A finished part is skipped on the next
# run (delete its folder to redo it). Each part logs to clients/<part>.log.
set -euo pipefail

TUNIX_VERSION=0.1.7
AREAL_VERSION=1.0.4
TORCH_CPU=2.13.0+cpu
PYTHON=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CLIENTS_DIR=${CLIENTS_DIR:-${RINGSERVE_CACHE:-$HOME/.cache/ringserve}/clients}

mkdir -p "$CLIENTS_DIR"

say() { echo "[install_clients] $*" >&2; }

timed() {  # timed NAME FUNCTION: run FUNCTION, log to CLIENTS_DIR/NAME.log, report the seconds
    local name=$1 fn=$2 t0 rc=0
    if [ -f "$CLIENTS_DIR/$name/.installed" ]; then
        say "$name: already installed ($(cat "$CLIENTS_DIR/$name/.installed"))"
        return 0
    fi
    t0=$(date +%s)
    say "$name: installing (log: $CLIENTS_DIR/$name.log) ..."
    set +e  # (a function run in a `||` list would ignore its own failures: a subshell with -e of its own)
    ( set -e; "$fn" ) > "$CLIENTS_DIR/$name.log" 2>&1
    rc=$?
    set -e
    if [ $rc -ne 0 ]; then
        say "$name: FAILED (exit $rc) after $(( $(date +%s) - t0 )) s; last lines of the log:"
        tail -n 15 "$CLIENTS_DIR/$name.log" >&2
        return $rc
    fi
    say "$name: done in $(( $(date +%s) - t0 )) s"
}

runtime_deps() {  # ringserve's runtime dependencies, one per line, as pyproject.toml lists them
    "$PYTHON" -c 'import sys, tomllib; print("\n".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))' \
        "$ROOT/pyproject.toml"
}

install_tunix() {
    local d=$CLIENTS_DIR/tunix
    rm -rf "$d" && "$PYTHON" -m venv "$d"
    # one resolve: tunix and ringserve's dependencies together (jax and flax as ringserve pins them)
    mapfile -t deps < <(runtime_deps)
    "$d/bin/pip" install "google-tunix==$TUNIX_VERSION" "${deps[@]}"
    "$d/bin/python" -c 'import tunix.rl.rl_cluster, tunix.rl.grpo.grpo_learner, jax, flax; print("tunix ok, jax", jax.__version__, "flax", flax.__version__)'
    echo "google-tunix $TUNIX_VERSION" > "$d/.installed"
}

install_areal() {
    local d=$CLIENTS_DIR/areal
    rm -rf "$d" && "$PYTHON" -m venv "$d"
    "$d/bin/pip" install "torch==$TORCH_CPU" || "$d/bin/pip" install torch
    "$d/bin/pip" install --no-deps "areal==$AREAL_VERSION"
    # what `areal.engine.sglang_remote` and its config import (areal's own list pins CUDA builds;
    # transformers within areal's pin)
    "$d/bin/pip" install ray aiohttp requests "transformers>=5.0,<=5.3.0" tokenizers safetensors numpy pydantic \
        uvloop tensordict hydra-core omegaconf pyyaml psutil packaging einops datasets wandb swanlab tabulate \
        colorlog networkx regex pybase64 math-verify orjson msgspec aiofiles fastapi uvicorn python-dotenv \
        matplotlib tensorboardx torchdata peft mathruler flask lark numba
    # huggingface's `kernels` (pulled in on the side) is newer than that transformers reads: an import error
    "$d/bin/pip" uninstall -y kernels || true
    "$d/bin/python" -c 'from areal.engine.sglang_remote import RemoteSGLangEngine; from areal.api.cli_args import InferenceEngineConfig; print("areal ok")'
    echo "areal $AREAL_VERSION (torch $("$d/bin/python" -c 'import torch; print(torch.__version__)'))" > "$d/.installed"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tunix areal)
status=0
for p in "${parts[@]}"; do
    case $p in
        tunix) timed tunix install_tunix || status=1 ;;
        areal) timed areal install_areal || status=1 ;;
        *) say "unknown part '$p' (tunix, areal)"; exit 2 ;;
    esac
done
exit $status
