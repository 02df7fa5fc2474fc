#!/usr/bin/env bash
# A change measured against an earlier revision, interleaved round by round so both see the same
# machine: the data-parallel MLP (2 ranks), the parameter-server CTR job (2 servers × 2 trainers,
# sync and async, 200 steps) and the pipeline bubble (4 stages, 8 micro-batches, 1F1B and
# FThenB, fixed-cost blocks). Prints one line per run: which, figure, value(s).
#   bash benches/before_after.sh REV [ROUNDS]      (ROUNDS defaults to 3)
# REV is built in a temporary worktree with its own target directory (a clean release build).
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: bash benches/before_after.sh REV [ROUNDS]}
rounds=${2:-3}
work=$(mktemp -d)
trap 'git worktree remove --force "$work/before" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add --detach "$work/before" "$rev" >/dev/null
cargo build --release --quiet --bin flotilla
cp target/release/flotilla "$work/flotilla-after"
(cd "$work/before" && CARGO_TARGET_DIR="$work/target" cargo build --release --quiet --bin flotilla)
cp "$work/target/release/flotilla" "$work/flotilla-before"
after_tree=$PWD

summary() { # file, which, figure, keys...
    python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], *[round(s[k], 4) for k in sys.argv[4:]])' "$@"
}

for _ in $(seq 1 "$rounds"); do
    for which in before after; do
        bin=$work/flotilla-$which
        if [ "$which" = before ]; then cd "$work/before"; else cd "$after_tree"; fi
        dir=$(mktemp -d)
        RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 timeout 600 "$bin" launch --nproc_per_node 2 --started_port 6570 -- \
            train --config benches/dp_mlp.toml --set train.batch_size=512 --run-dir "$dir" >/dev/null 2>&1
        summary "$dir/summary.json" "$which" dp_mlp_2 samples_per_sec comm_time_ratio
        rm -rf "$dir"
        for mode in sync async; do
            extra=()
            [ "$mode" = async ] && extra=(--set strategy.a_sync=true)
            dir=$(mktemp -d)
            timeout 600 "$bin" launch-ps --server_num 2 --worker_num 2 --started_port 17170 -- \
                train --config examples/ctr_ps.toml --set train.steps=200 "${extra[@]}" --run-dir "$dir" >/dev/null 2>&1
            summary "$dir/summary.json" "$which" "ctr_2x2_$mode" samples_per_sec auc
            rm -rf "$dir"
        done
        for schedule in 1F1B FThenB; do
            "$bin" bench pipeline --stages 4 --micro-batches 8 --schedule "$schedule" --json 2>/dev/null |
                python3 -c 'import json,sys
for line in sys.stdin:
    if line.startswith("{"):
        print(sys.argv[1], "bubble_4x8_" + sys.argv[2], round(json.loads(line)["bubble_share"], 4))' "$which" "$schedule"
        done
    done
done
