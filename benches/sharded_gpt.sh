#!/usr/bin/env bash
# The GPT trained data-parallel, with sharded states (strategy.sharding, stages 1, 2 and 3) and split
# by tensor parallelism over every rank (hybrid_configs.mp_degree, layout "mp"), by 1, 2 and 4
# trainer processes on loopback, one compute thread each — as
# ../shared/peers/torch_sharded_gpt.py runs PyTorch's DDP, FSDP2 and DTensor tensor parallelism
# ("tp") (same shape: 4 heads, a
# 64-token window, the text's 78-character vocabulary, AdamW). Prints one JSON line per layout
# and world size: tokens/s (global, from the median step time after the first 3 steps, as the
# peer counts), rank 0's bytes of parameters, averaged gradients and optimizer state
# (summary.json's state_bytes) and the largest peak RSS of the ranks.
#   bash benches/sharded_gpt.sh [world sizes...]             (default: 1 2 4)
#   N_EMBD=384 N_LAYER=4 BATCH=16 STEPS=12 LAYOUTS="dp mp" bash benches/sharded_gpt.sh 4
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/flotilla
port=${PORT:-6590}
n_embd=${N_EMBD:-384} n_layer=${N_LAYER:-4} batch=${BATCH:-16} steps=${STEPS:-12}
for world in ${@:-1 2 4}; do
  for layout in ${LAYOUTS:-dp stage1 stage2 stage3 mp}; do
    case $layout in
      dp) sharding=() ;;
      stage1) sharding=(--set strategy.sharding=true --set strategy.sharding_configs.stage=1) ;;
      stage2) sharding=(--set strategy.sharding=true --set strategy.sharding_configs.stage=2) ;;
      stage3) sharding=(--set strategy.sharding=true --set strategy.sharding_configs.stage=3) ;;
      mp) sharding=(--set strategy.hybrid_configs.dp_degree=1 --set "strategy.hybrid_configs.mp_degree=$world") ;;
    esac
    [ "$world" = 1 ] && [ "$layout" != dp ] && continue
    dir=$(mktemp -d)
    RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 timeout 900 "$bin" launch --nproc_per_node "$world" --started_port "$port" -- \
      train --config examples/gpt.toml --set "train.steps=$steps" --set "train.batch_size=$batch" \
      --set "train.gpt.n_embd=$n_embd" --set "train.gpt.n_layer=$n_layer" --set train.gpt.n_head=4 \
      --set train.gpt.block_size=64 --set train.test_fraction=0.002 --set train.eval_every=0 \
      --set "strategy.check_every=0" "${sharding[@]}" --run-dir "$dir" >/dev/null 2>&1
    python3 - "$dir" "$layout" "$batch" <<'EOF'
import json, statistics, sys
run, layout, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
summary = json.load(open(f"{run}/summary.json"))
steps = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
median = statistics.median(s["step_time_s"] for s in steps[3:])
print(json.dumps(dict(layout=layout, world_size=summary["world_size"], tokens_per_sec=batch * 64 / median,
                      median_step_s=median, matrix_kernel=summary["matrix_kernel"], **summary["state_bytes"],
                      peak_rss_bytes=max(s["peak_rss_bytes"] for s in steps))))
EOF
    rm -rf "$dir"
  done
done
