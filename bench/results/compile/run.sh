#!/usr/bin/env bash
# The compile reports below: tools/launch_tpu.sh --dry-run (the launcher's own flags, tp = the
# topology's chips) for each topology and model shape, each family's program the estimates need
# (the largest decode batch, the smallest extend). From the repository root:
#   bash bench/results/compile/run.sh [TOPOLOGY ...]
set -uo pipefail
here=bench/results/compile
topologies=("$@")
[ ${#topologies[@]} -gt 0 ] || topologies=(v5e:1x1 v5e:2x2 v6e:2x4 v5p:2x2x1)
for topo in "${topologies[@]}"; do
  for model in tiny smollm2 qwen3-8b llama-3-8b; do
    name="${topo/:/-}_${model}"
    RINGSERVE_COMPILE_ARGS="--programs decode:max,extend:min --jobs 2 --json $here/$name.json" \
      nice -n 10 bash tools/launch_tpu.sh --dry-run --topology "$topo" --model "$model" > "$here/$name.txt" 2>&1
    grep -v "WARNING\|^E0000\|Source Location\|learning/" "$here/$name.txt" | tail -4
  done
done
