#!/usr/bin/env bash
# Time to load a 100 MB+ pipeline checkpoint on the layout that wrote it against re-cutting it
# (merging its stage files into the whole model, each new stage taking its own) into another:
# a 2-stage pipeline of a 4-block MLP (hidden 2896 × 3: ~34 M parameters, ~134 MB of
# parameters and momentum) writes the checkpoint of step 1; it is resumed for one step as 2
# stages, as 4 stages and as one data-parallel pair, REPEAT times each, and every stage's
# "state restored" time (read, re-cut and load into the model) is printed.
#
#   bash benches/reshard_load.sh            # REPEAT=3
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${FLOTILLA:-target/release/flotilla}
REPEAT=${REPEAT:-3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); avx512: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no)"
model=(--set 'train.hidden_sizes=[2896, 2896, 2896]' --set train.batch_size=48 --set train.log_every=1)
"$BIN" train --run-dir "$dir/run" "${model[@]}" --set strategy.pipeline=true \
    --set strategy.hybrid_configs.pp_degree=2 --set cluster.nproc_per_node=2 --set train.steps=2 \
    --set fault_tolerance.checkpoint_every=1 2>/dev/null
bytes=$(du -cb "$dir"/run/checkpoints/step-00000001/*.safetensors | tail -1 | cut -f1)
echo "checkpoint of step 1: $((bytes / 1000000)) MB in $(ls "$dir"/run/checkpoints/step-00000001/*.safetensors | wc -l) stage files"
resume() {
    local label=$1
    shift
    for _ in $(seq "$REPEAT"); do
        "$BIN" train --resume "$dir/run" --set train.steps=2 "$@" 2>&1 >/dev/null |
            grep -o 'state restored rank=[0-9]* step=1 from="disk" bytes=[0-9]* seconds=[0-9.]*' |
            awk -v label="$label" '{ split($NF, s, "="); if (s[2] > worst) worst = s[2] } END { printf "%-28s slowest stage %.3f s\n", label, worst }'
    done
}
resume "same layout (2 stages)"
resume "re-cut into 4 stages" --set strategy.hybrid_configs.pp_degree=4 --set cluster.nproc_per_node=4
resume "re-cut into 1 (dp = 2)" --set strategy.pipeline=false --set strategy.hybrid_configs.pp_degree=1
