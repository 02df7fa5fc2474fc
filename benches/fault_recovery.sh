#!/usr/bin/env bash
# Time from a fault to training resumed, at the heartbeat defaults (1000 ms x 5 misses).
# Launches the default job (2 trainers on loopback, checkpoints every 500 steps, one restart
# allowed), hits one trainer after the first checkpoint, and reads the launcher's log:
#   kill -9  : the process dies; its ring neighbour and the launcher see it at once.
#   SIGSTOP  : the process hangs; the coordinator declares it dead when its heartbeats stop.
# Usage: benches/fault_recovery.sh [path/to/flotilla]   (default: target/release/flotilla)
set -euo pipefail
flotilla=${1:-target/release/flotilla}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

seconds() { date -d "$1" +%s.%N; }

run() {
    local signal=$1 port=$2
    local log="$work/$signal.log" checkpoints="$work/$signal-checkpoints"
    "$flotilla" launch --nproc_per_node 2 --started_port "$port" -- train --config config.toml \
        --set train.steps=3000 --set fault_tolerance.checkpoint_every=500 \
        --set fault_tolerance.checkpoint_dir="$checkpoints" --set fault_tolerance.max_restarts=1 \
        --run-dir "$work/$signal-run" >"$log" 2>&1 &
    local launcher=$!
    for _ in $(seq 1 1000); do
        [ -e "$checkpoints/step-00000500/manifest.json" ] && break
        sleep 0.01
    done
    local victim
    victim=$(cat /proc/$launcher/task/*/children | tr ' ' '\n' | grep -v '^$' | sort -n | tail -1)
    local hit
    hit=$(date -u +%Y-%m-%dT%H:%M:%S.%NZ)
    kill "-$signal" "$victim"
    wait "$launcher" || { echo "the job failed after SIG$signal:"; tail -20 "$log"; exit 1; }
    local resumed
    resumed=$(grep -m1 -o '[0-9T:.-]*Z  INFO resuming from checkpoint' "$log" | head -1 | cut -d' ' -f1)
    awk -v s="$signal" -v a="$(seconds "$hit")" -v b="$(seconds "$resumed")" \
        'BEGIN { printf "SIG%-5s of rank 1 -> training resumed after %.2f s\n", s, b - a }'
}

run KILL 7410
run STOP 7420
