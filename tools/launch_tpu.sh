#!/usr/bin/env bash
# Serve a model on one TPU host: `ringserve serve` over every local chip, dp x tp of them.
#
#   tools/launch_tpu.sh [--dry-run [--topology T]] [--model M] [any `ringserve serve` flag ...]
#
# Installs nothing: install ringserve first (README command 1, with `jax[tpu]` on the host).
# It finds the chips through JAX, asks `ringserve launch-plan` (actors/cli/launch_plan.py) for
# dp x tp = chips (data parallel where the model is small or its heads do not split), the page
# size, running requests and buckets from the model and the HBM (printed, with why), and runs
# `ringserve serve` with them, bf16 and the TPU attention kernel it picks (jax's, or ringserve's
# where jax's would pad the KV); flags given here win (a --tp-size
# given: dp is the rest). Compiled programs persist in $RINGSERVE_CACHE/xla (--xla-cache).
# --dry-run prints the exact command and environment and serves nothing (it works on a host
# without TPU, saying so); where libtpu is importable (tools/install_libtpu.sh) it then runs
# `ringserve compile` for the same flags on --topology T (default: this host's chips, else
# v5e:1x1), compiling every step program ahead of time and reporting each
# (RINGSERVE_COMPILE_ARGS adds compile flags: --programs decode:max, --json PATH, ...).
# Without --dry-run, a host without TPU is an error (exit 2).
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
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
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
read -r platform chips kind < <("$py" -c 'import jax; d = jax.local_devices(); print(d[0].platform, len(d), d[0].device_kind)' 2>/dev/null || echo "none 0")

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

# dp x tp, page size, running requests and buckets (one host; many hosts: tp over every chip)
if [ "${#multi[@]}" -eq 0 ]; then
  planned="$chips" chip=(--device-kind "$kind")
  [ "$platform" = "tpu" ] || { planned="${RINGSERVE_CHIPS:-4}"; chip=(--chip "${RINGSERVE_CHIP:-v5e}"); }
  plan=$("$bin" launch-plan --chips "$planned" "${chip[@]}" -- "${extra[@]}") || exit 2
  read -r -a layout <<< "$plan"
  sized=()
else
  layout=(--tp-size "$tp")
  sized=(--page-size 64 --max-running-requests 256 --decode-bucket-step 0 --max-prefill-tokens 8192
         --chunked-prefill-size 4096 --extend-block 64 --attention-backend pallas)
fi

env_vars=(
  "JAX_PLATFORMS=tpu"                 # fail fast rather than fall back to CPU
  "XLA_PYTHON_CLIENT_PREALLOCATE=false"
  "TPU_MIN_LOG_LEVEL=1"
)
cmd=("$bin" serve
  "${layout[@]}"
  "${multi[@]}"
  "${sized[@]}"
  --dtype bfloat16
  "${extra[@]}")

if [ "$platform" != "tpu" ]; then
  msg="launch_tpu.sh: JAX sees no TPU on this host (it sees ${chips} ${platform} device(s))"
  if [ "$dry_run" -eq 0 ]; then
    echo "$msg; run this on a TPU host (or pass --dry-run to see the command)" >&2
    exit 2
  fi
  echo "# $msg: the command below would fail here (planned for ${planned:-$tp} x ${RINGSERVE_CHIP:-v5e}: RINGSERVE_CHIPS, RINGSERVE_CHIP)" >&2
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
  if [ -z "$topology" ]; then  # this host's chips as libtpu names them; off TPU, the planned ones
    topology=$("$py" - "$platform" "${kind:-}" "${planned:-$tp}" "${RINGSERVE_CHIP:-v5e}" <<'PY' 2>/dev/null || echo "v5e:1x1"
import sys
platform, kind, n, chip = sys.argv[1], sys.argv[2].lower(), int(sys.argv[3]), sys.argv[4]
if platform == "tpu":  # "tpu v5 lite", "tpu v6 lite", "tpu v5", "tpu v4"
    chip = "v5e" if "v5 lite" in kind else "v6e" if "v6" in kind else "v5p" if "v5" in kind else "v4"
flat = {1: "1x1", 4: "2x2", 8: "2x4"}.get(n, f"{n}x1")
print(f"{chip}:{flat if chip in ('v5e', 'v6e') else {1: '1x1x1', 4: '2x2x1', 8: '2x2x2'}.get(n, f'{n}x1x1')}")
PY
)
  fi
  if [ "${#multi[@]}" -gt 0 ]; then
    echo "# launch_tpu.sh: a multi-host slice's programs are not compiled here (ringserve compile --topology <the slice> --tp-size $tp does)" >&2
    exit 0
  fi
  # one dp group's programs (every group compiles the same ones), on the plan's tp chips of it
  compile=("$bin" compile --topology "$topology" "${cmd[@]:2}")
  # shellcheck disable=SC2206
  compile+=(${RINGSERVE_COMPILE_ARGS:-})
  echo "# launch_tpu.sh: compiling its step programs for $topology (libtpu, ahead of time):" >&2
  printf '%q ' "${compile[@]}" >&2
  echo >&2
  exec env PYTHONUNBUFFERED=1 "${compile[@]}"
fi
exec env "${env_vars[@]}" "${cmd[@]}"
