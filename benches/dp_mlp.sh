#!/usr/bin/env bash
# Data-parallel MLP throughput with 1, 2 and 4 trainer processes on loopback,
# one compute thread each (as the PyTorch DDP peer). Prints one JSON summary
# a line: samples_per_sec (global), comm_time_ratio, exposed_comm_ratio, the
# matrix kernel and the gradients' wire format.
#   bash benches/dp_mlp.sh [world sizes...]       (default: 1 2 4)
#   FP16_ALLREDUCE=1 bash benches/dp_mlp.sh 4     (bfloat16 buckets: strategy.fp16_allreduce)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/flotilla
port=${PORT:-6570}
for n in "${@:-1 2 4}"; do
  for world in $n; do
    dir=$(mktemp -d)
    RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 timeout 600 "$bin" launch --nproc_per_node "$world" --started_port "$port" -- \
      train --config benches/dp_mlp.toml --set "train.batch_size=$((256 * world))" ${FUSE_MB:+--set strategy.fuse_grad_size_in_MB=$FUSE_MB} \
      ${FP16_ALLREDUCE:+--set strategy.fp16_allreduce=true} --run-dir "$dir" >/dev/null 2>&1
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); f={k: s[k] for k in ("world_size","steps","samples_per_sec","comm_time_ratio","exposed_comm_ratio","matrix_kernel")}; f["wire"]=sys.argv[2]; print(json.dumps(f))' \
      "$dir/summary.json" "$([ -n "${FP16_ALLREDUCE:-}" ] && echo bf16 || echo f32)"
    rm -rf "$dir"
  done
done
