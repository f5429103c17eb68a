#!/usr/bin/env bash
# The compile reports below: tools/launch_tpu.sh --dry-run for a topology and a model, so the
# launcher's own flags (what `ringserve launch-plan` chooses for that many chips of that
# generation: dp x tp, ep, page size, running requests, buckets, the attention kernel) compile for
# one dp group; the programs the estimates need (the largest decode batch, the smallest extend).
# A model is a named shape (model/checkpoints/config_shapes.py) or tiny-<arch>, a tiny random
# checkpoint of a family (made here, under $RINGSERVE_TINY, default /tmp/ringserve-tiny).
# From the repository root:
#   bash bench/results/compile/run.sh [TOPOLOGY:MODEL ...]    (default: all below, in this order)
set -uo pipefail
here=bench/results/compile
tiny="${RINGSERVE_TINY:-/tmp/ringserve-tiny}"
pairs=("$@")
if [ ${#pairs[@]} -eq 0 ]; then
  for topo in v5e:1x1 v5e:2x2 v6e:2x4 v5p:2x2x1; do
    for model in tiny smollm2 qwen3-8b llama-3-8b gemma-2-2b tiny-gemma2 tiny-gemma3 tiny-qwen3_moe tiny-qwen2_moe \
                 tiny-mixtral; do
      pairs+=("$topo:$model")
    done
  done
  pairs+=(v5p:2x2x1:qwen3-30b-a3b v6e:2x4:qwen3-30b-a3b)
fi
for pair in "${pairs[@]}"; do
  topo=${pair%:*} model=${pair##*:}
  chip=${topo%%:*} dims=${topo#*:} chips=1
  for d in ${dims//x/ }; do chips=$((chips * d)); done
  if [[ $model == tiny-* ]]; then
    arch=${model#tiny-}
    [ -f "$tiny/$arch/config.json" ] || ringserve make-tiny-model --arch "$arch" "$tiny/$arch" > /dev/null
    path="$tiny/$arch"
  else
    path=$model
  fi
  name="${topo/:/-}_${model}"
  RINGSERVE_CHIPS=$chips RINGSERVE_CHIP=$chip \
    RINGSERVE_COMPILE_ARGS="--programs decode:max,extend:min --jobs 1 --json $here/$name.json" \
    nice -n 19 bash tools/launch_tpu.sh --dry-run --topology "$topo" --model "$path" > "$here/$name.txt" 2>&1
  grep -v "WARNING\|^E0000\|Source Location\|learning/" "$here/$name.txt" | tail -3
done
