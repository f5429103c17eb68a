#!/usr/bin/env bash
# Serve a model on one TPU host: `ringserve serve` over every local chip (the `tp` mesh axis).
#
#   tools/launch_tpu.sh [--dry-run [--topology T]] [--model M] [any `ringserve serve` flag ...]
#
# Installs nothing: install ringserve first (README command 1, with `jax[tpu]` on the host).
# It finds the chips through JAX and runs `ringserve serve` with --tp-size = chips, bf16, and
# the page size, buckets and attention backend suited to TPU; flags given here come last, so
# they win. The KV pool is left to the server's sizing against HBM. --dry-run prints the exact
# command and environment and serves nothing (it works on a host without TPU, saying so); where
# libtpu is importable (tools/install_libtpu.sh) it then runs `ringserve compile` for the same
# flags on --topology T (default: this host's chips, else v5e:1x1; --tp-size is its chip
# count), compiling every step program ahead of time and reporting each (RINGSERVE_COMPILE_ARGS
# adds compile flags: --programs decode:max, --json PATH, ...). Without --dry-run, a host
# without TPU is an error (exit 2).
# RINGSERVE_BIN picks the ringserve executable (default: the one on PATH).
# A multi-host slice (TPU_WORKER_HOSTNAMES lists more than one host; TPU_WORKER_ID is this
# one's index, as GKE and the TPU VM images set them): every worker runs this same command; it
# adds --nnodes, --node-rank and --dist-init-addr <first host>:${RINGSERVE_DIST_PORT:-8476}, and
# --tp-size counts every host's chips. Export the same RINGSERVE_DIST_TOKEN on every worker.
set -euo pipefail

dry_run=0
topology=""
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --topology) topology="$2"; shift ;;
    --topology=*) topology="${1#*=}" ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) extra+=("$1") ;;
  esac
  shift
done

bin="${RINGSERVE_BIN:-$(command -v ringserve || true)}"
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  echo "launch_tpu.sh: no ringserve executable (install it first: README command 1, or set RINGSERVE_BIN)" >&2
  exit 2
fi
py="$(dirname "$bin")/python"
[ -x "$py" ] || py=python3

# The chips, as JAX sees them on this host (JAX_PLATFORMS is left to the environment).
read -r platform chips < <("$py" -c 'import jax; d = jax.local_devices(); print(d[0].platform, len(d))' 2>/dev/null || echo "none 0")

# Many hosts: one runner per worker, one jax.distributed program (README "Many hosts").
multi=()
tp="$chips"
IFS=, read -r -a workers <<< "${TPU_WORKER_HOSTNAMES:-}"
if [ "${#workers[@]}" -gt 1 ]; then
  nnodes="${#workers[@]}"
  tp=$((chips * nnodes))
  multi=(--nnodes "$nnodes" --node-rank "${TPU_WORKER_ID:?TPU_WORKER_HOSTNAMES lists several hosts: set TPU_WORKER_ID}"
         --dist-init-addr "${workers[0]}:${RINGSERVE_DIST_PORT:-8476}")
  [ -n "${RINGSERVE_DIST_TOKEN:-}" ] || echo "# launch_tpu.sh: export the same RINGSERVE_DIST_TOKEN on every worker" >&2
fi

env_vars=(
  "JAX_PLATFORMS=tpu"                 # fail fast rather than fall back to CPU
  "XLA_PYTHON_CLIENT_PREALLOCATE=false"
  "TPU_MIN_LOG_LEVEL=1"
)
cmd=("$bin" serve
  --tp-size "$tp"
  "${multi[@]}"
  --dtype bfloat16
  --attention-backend pallas          # jax's ragged paged attention kernel
  --page-size 64                      # the kernel reads whole pages per block: bigger pages, fewer DMAs
  --max-running-requests 256
  --max-prefill-tokens 8192
  --chunked-prefill-size 4096
  --extend-block 64
  "${extra[@]}")

if [ "$platform" != "tpu" ]; then
  msg="launch_tpu.sh: JAX sees no TPU on this host (it sees ${chips} ${platform} device(s))"
  if [ "$dry_run" -eq 0 ]; then
    echo "$msg; run this on a TPU host (or pass --dry-run to see the command)" >&2
    exit 2
  fi
  echo "# $msg: the command below would fail here" >&2
fi

if [ "$dry_run" -eq 1 ]; then
  printf 'env'
  printf ' %q' "${env_vars[@]}"
  printf ' %q' "${cmd[@]}"
  printf '\n'
  libtpu_dir="${RINGSERVE_LIBTPU_DIR:-$HOME/.cache/ringserve/libtpu}"
  if ! "$py" -c 'import libtpu' 2>/dev/null && [ ! -d "$libtpu_dir/libtpu" ]; then
    echo "# launch_tpu.sh: no libtpu here (tools/install_libtpu.sh installs it): the programs are not compiled" >&2
    exit 0
  fi
  if [ -z "$topology" ]; then  # this host's chips, as libtpu names them; else the smallest slice
    topology=$("$py" - "$platform" "$chips" <<'PY' 2>/dev/null || echo "v5e:1x1"
import sys, jax
if sys.argv[1] != "tpu":
    raise SystemExit(1)
kind = jax.local_devices()[0].device_kind.lower()  # "tpu v5 lite", "tpu v6 lite", "tpu v5", "tpu v4"
gen = "v5e" if "v5 lite" in kind else "v6e" if "v6" in kind else "v5p" if "v5" in kind else "v4"
n = int(sys.argv[2])
print(f"{gen}:{ {1: '1x1', 4: '2x2', 8: '2x4'}.get(n, f'{n}x1') if gen in ('v5e', 'v6e') else {4: '2x2x1', 8: '2x2x2'}.get(n, f'{n}x1x1')}")
PY
)
  fi
  topo_chips=$(IFS=x; n=1; for d in ${topology#*:}; do n=$((n * d)); done; echo "$n")
  [ "${#multi[@]}" -eq 0 ] || echo "# launch_tpu.sh: compiling this host's share only is not done: the whole slice is $topology" >&2
  compile=("$bin" compile --topology "$topology" "${cmd[@]:2}" --tp-size "$topo_chips")
  # shellcheck disable=SC2206
  compile+=(${RINGSERVE_COMPILE_ARGS:-})
  echo "# launch_tpu.sh: compiling its step programs for $topology (libtpu, ahead of time):" >&2
  printf '%q ' "${compile[@]}" >&2
  echo >&2
  exec env PYTHONUNBUFFERED=1 "${compile[@]}"
fi
exec env "${env_vars[@]}" "${cmd[@]}"
