#!/usr/bin/env bash
# CTR training throughput on parameter servers, as real processes on loopback:
# servers × trainers ∈ {1×1, 2×2, 2×4}, each in sync, async and geo mode, the job of
# examples/ctr_ps.toml for STEPS steps — wide&deep, or DeepFM (400-400-400) with MODEL=deepfm.
# Prints one JSON line per run (from summary.json).
#   cargo build --release && bash benches/ctr_ps.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/flotilla}
STEPS=${STEPS:-200}
PORT=${PORT:-17170}
case ${MODEL:-wide_deep} in
    wide_deep) model=() ;;
    deepfm) model=(--set train.model=deepfm --set "train.hidden_sizes=[400, 400, 400]") ;;
    *) echo "MODEL=$MODEL: wide_deep or deepfm" >&2; exit 2 ;;
esac
for layout in 1x1 2x2 2x4; do
    servers=${layout%x*}
    trainers=${layout#*x}
    for mode in sync async geo; do
        case $mode in
            sync) extra=() ;;
            async) extra=(--set strategy.a_sync=true) ;;
            geo) extra=(--set strategy.a_sync=true --set strategy.a_sync_configs.k_steps=8) ;;
        esac
        dir=$(mktemp -d)
        log=$(mktemp)
        "$BIN" launch-ps --server_num "$servers" --worker_num "$trainers" --started_port "$PORT" -- \
            train --config examples/ctr_ps.toml --set train.steps="$STEPS" "${model[@]}" "${extra[@]}" --run-dir "$dir" \
            >/dev/null 2>"$log" || { cat "$log"; exit 1; }
        python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(json.dumps({k: s[k] for k in ("servers","trainers","mode","samples_per_sec","auc","planted_auc")}))' "$dir/summary.json"
        rm -rf "$dir" "$log"
    done
done
