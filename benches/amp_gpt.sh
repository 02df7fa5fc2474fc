#!/usr/bin/env bash
# The GPT in one process on one compute thread, in f32 and with strategy.amp (bfloat16 products,
# f32 sums), beside PyTorch's f32 and CPU autocast to bfloat16 (benches/torch_gpt.py, the same
# shape: 4 heads, a 64-token window, the text's 78 characters, AdamW, batch 32) when $PY names
# its Python. Rounds alternate the four runs, so all see the same machine. Prints one JSON line
# per run: precision, tokens/s (global batch × window over the median step after the first 3,
# as the peer counts), the final loss.
#   PY=~/.cache/flotilla-peers/bin/python bash benches/amp_gpt.sh [N_EMBD ...]   (default: 64 384)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=target/release/flotilla
rounds=${ROUNDS:-2} steps=${STEPS:-30}
for n_embd in ${@:-64 384}; do
  for _ in $(seq 1 "$rounds"); do
    for precision in f32 bf16; do
      amp=()
      [ "$precision" = bf16 ] && amp=(--set strategy.amp=true --set strategy.amp_configs.use_bf16=true)
      dir=$(mktemp -d)
      RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 timeout 900 "$bin" train --config examples/gpt.toml \
        --set "train.steps=$steps" --set "train.gpt.n_embd=$n_embd" --set train.test_fraction=0.002 \
        --set train.eval_every=0 --set strategy.check_every=0 "${amp[@]}" --run-dir "$dir" >/dev/null 2>&1
      python3 - "$dir" "$precision" "$n_embd" <<'PYEOF'
import json, statistics, sys
run, precision, n_embd = sys.argv[1], sys.argv[2], int(sys.argv[3])
summary = json.load(open(f"{run}/summary.json"))
steps = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
median = statistics.median(s["step_time_s"] for s in steps[3:])
print(json.dumps(dict(runtime="flotilla", precision=precision, n_embd=n_embd, tokens_per_sec=round(32 * 64 / median),
                      final_loss=round(summary["final_loss"], 4), matrix_kernel=summary["matrix_kernel"])))
PYEOF
      rm -rf "$dir"
      if [ -n "${PY:-}" ]; then
        flag=()
        [ "$precision" = bf16 ] && flag=(--bf16)
        "$PY" benches/torch_gpt.py --threads 1 --steps "$steps" --n-embd "$n_embd" "${flag[@]}"
      fi
    done
  done
done
