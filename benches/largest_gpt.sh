#!/usr/bin/env bash
# The largest GPT that trains on this machine with 4 trainer processes: plain data parallelism
# against sharded parameters (ZeRO stage 3, strategy.sharding_configs.stage=3). For each layout and
# each depth, a job of `flotilla launch --nproc_per_node 4` trains STEPS steps, scores the held-out
# split and writes params.safetensors inside a memory cgroup limited to LIMIT_GIB (the machine's
# memory, less what the system keeps), while the total resident set of the job's processes is
# sampled every 0.2 s. Prints one JSON line per run: the layout, the model's parameters (counted
# in its params.safetensors), whether it finished, the peak of the total resident set and the
# cgroup's own peak (which counts the page cache of the files written too), the last step's time
# and every step's loss.
# Needs root (a cgroup v1 memory controller at /sys/fs/cgroup/memory).
#   bash benches/largest_gpt.sh                                    (dp at 2..4 layers, stage3 at 12..16)
#   LAYOUT=stage3 LAYERS="18 20" N_EMBD=2048 bash benches/largest_gpt.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet
bin=$PWD/target/release/flotilla
port=${PORT:-6690}
n_embd=${N_EMBD:-2048} n_head=${N_HEAD:-16} steps=${STEPS:-3} limit_gib=${LIMIT_GIB:-22}
cgroups=/sys/fs/cgroup/memory
[ -w "$cgroups" ] || { echo "largest_gpt.sh: needs a writable cgroup v1 memory controller at $cgroups (run as root)" >&2; exit 1; }

# The cgroup of the run in progress (one at a time).
group=$cgroups/flotilla-largest-gpt-$$

# Whatever a run left (an interrupted script): its processes killed, its cgroup removed.
cleanup() {
  [ -d "$group" ] || return 0
  for pid in $(cat "$group/cgroup.procs"); do kill -9 "$pid" 2>/dev/null || true; done
  sleep 1
  rmdir "$group"
}
trap cleanup EXIT

# One run of `layout` at `layers` layers; prints its JSON line.
run() {
  local layout=$1 layers=$2 sharding=()
  [ "$layout" = stage3 ] && sharding=(--set strategy.sharding=true --set strategy.sharding_configs.stage=3)
  local dir
  dir=$(mktemp -d)
  mkdir "$group"
  echo $((limit_gib << 30)) > "$group/memory.limit_in_bytes"
  (
    echo $BASHPID > "$group/cgroup.procs"
    exec env RAYON_NUM_THREADS=1 CANDLE_NUM_THREADS=1 timeout 1800 "$bin" launch --nproc_per_node 4 \
      --started_port "$port" -- train --config examples/gpt.toml --set "train.steps=$steps" \
      --set train.batch_size=4 --set train.lr=0.00001 --set train.warmup_steps=0 --set "train.gpt.n_embd=$n_embd" \
      --set "train.gpt.n_layer=$layers" --set "train.gpt.n_head=$n_head" --set train.gpt.block_size=64 \
      --set train.test_fraction=0.0005 --set train.eval_every=0 --set strategy.check_every=0 \
      --set train.log_every=1 --set fault_tolerance.timeout_s=1200 "${sharding[@]}" --run-dir "$dir"
  ) >"$dir.log" 2>&1 &
  local job=$! peak=0 total rss
  while kill -0 "$job" 2>/dev/null; do
    total=0
    for pid in $(cat "$group/cgroup.procs" 2>/dev/null); do
      rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null || true)
      total=$((total + ${rss:-0}))
    done
    [ "$total" -gt "$peak" ] && peak=$total
    sleep 0.2
  done
  local finished=true
  wait "$job" || finished=false
  local cgroup_peak
  cgroup_peak=$(cat "$group/memory.max_usage_in_bytes")
  rmdir "$group"
  python3 - "$dir" "$layout" "$layers" "$finished" "$peak" "$cgroup_peak" <<'EOF'
import json, math, os, struct, sys
run, layout, layers, finished, peak_kib, cgroup_peak = sys.argv[1:]
finished = finished == "true" and os.path.exists(f"{run}/summary.json")
line = dict(layout=layout, n_layer=int(layers), finished=finished, peak_rss_gib=int(peak_kib) / 2**20,
            cgroup_peak_gib=int(cgroup_peak) / 2**30)
if finished:
    with open(f"{run}/params.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    line["parameters"] = sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    steps = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
    line["step_time_s"] = steps[-1]["step_time_s"]
    line["losses"] = [round(s["loss"], 4) for s in steps]
print(json.dumps(line), flush=True)
EOF
  [ "$finished" = true ] || tail -5 "$dir.log" >&2
  rm -rf "$dir" "$dir.log"
}

if [ -n "${LAYOUT:-}" ]; then
  for layers in $LAYERS; do run "$LAYOUT" "$layers"; done
else
  for layers in 2 3 4; do run dp "$layers"; done
  for layers in 12 14 16; do run stage3 "$layers"; done
fi
