#!/usr/bin/env bash
# The compile reports below: tools/launch_tpu.sh --dry-run (the launcher's own flags, tp = the
# topology's chips) for a topology and model shape, the programs the estimates need (the largest
# decode batch, the smallest extend). From the repository root:
#   bash bench/results/compile/run.sh [TOPOLOGY:MODEL ...]    (default: all below, in this order)
set -uo pipefail
here=bench/results/compile
pairs=("$@")
[ ${#pairs[@]} -gt 0 ] || pairs=(v5e:1x1:tiny v5e:1x1:smollm2 v5e:1x1:qwen3-8b v5e:1x1:llama-3-8b
  v5e:2x2:tiny v5e:2x2:llama-3-8b v6e:2x4:llama-3-8b v6e:2x4:qwen3-8b v5e:2x2:qwen3-8b v5p:2x2x1:llama-3-8b
  v5p:2x2x1:qwen3-8b v5e:2x2:smollm2 v6e:2x4:smollm2 v6e:2x4:tiny v5p:2x2x1:smollm2 v5p:2x2x1:tiny)
for pair in "${pairs[@]}"; do
  topo=${pair%:*} model=${pair##*:}
  name="${topo/:/-}_${model}"
  RINGSERVE_COMPILE_ARGS="--programs decode:max,extend:min --jobs 2 --json $here/$name.json" \
    nice -n 10 bash tools/launch_tpu.sh --dry-run --topology "$topo" --model "$model" > "$here/$name.txt" 2>&1
  grep -v "WARNING\|^E0000\|Source Location\|learning/" "$here/$name.txt" | tail -4
done
