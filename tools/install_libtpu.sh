#!/usr/bin/env bash
# libtpu for compiling against TPU topologies on a host without a TPU (`ringserve compile`,
# the `tpu_aot` tests): installed into its own directory, outside any venv, since a libtpu
# beside a CPU JAX would make every process look for a TPU. `ringserve compile` adds the
# directory to sys.path itself when libtpu is not importable otherwise
# (model/compute/tpu_topology.py `ensure_libtpu`).
#
#   tools/install_libtpu.sh            into ${RINGSERVE_LIBTPU_DIR:-~/.cache/ringserve/libtpu}
#
# The version is the one `jax[tpu]` pins for the installed jax (its metadata's Requires-Dist:
# jax 0.10.2 -> libtpu==0.0.42.*, 0.0.42.1 the wheel on PyPI); PYTHON picks the interpreter
# whose jax is read (default: python3). Idempotent: an installed matching libtpu is kept.
set -euo pipefail

py=${PYTHON:-python3}
dir=${RINGSERVE_LIBTPU_DIR:-$HOME/.cache/ringserve/libtpu}
pin=$("$py" - <<'PY'
import importlib.metadata as m, re
reqs = m.requires("jax") or []
pins = [r.split(";")[0].strip() for r in reqs if r.startswith("libtpu") and 'extra == "tpu"' in r]
print(re.sub(r"\s+", "", pins[0]) if pins else "")
PY
)
[ -n "$pin" ] || { echo "install_libtpu.sh: the installed jax names no libtpu for its tpu extra" >&2; exit 2; }
if [ -d "$dir/libtpu" ] && PYTHONPATH="$dir" "$py" - "$pin" <<'PY'
import importlib.metadata as m, sys
from packaging.specifiers import SpecifierSet
spec = sys.argv[1][len("libtpu"):]
sys.exit(0 if m.version("libtpu") in SpecifierSet(spec) else 1)
PY
then
  echo "install_libtpu.sh: $pin already in $dir"
  exit 0
fi
mkdir -p "$dir"
pip=("$py" -m pip)
"$py" -m pip --version >/dev/null 2>&1 || pip=(python3 -m pip)  # a venv made without pip (libtpu's wheel is py3-none)
"${pip[@]}" install --quiet --no-deps --upgrade --target "$dir" "$pin"
echo "install_libtpu.sh: installed $pin into $dir"
