#!/usr/bin/env bash
# Kill -> training resumed, for a launched data-parallel job that loses rank 1 (SIGKILL, or
# SIGSTOP: found by its missed heartbeats, then killed by its launcher) after a checkpoint:
# flotilla in place (only rank 1 restarted; the survivors roll back inside their processes),
# flotilla restarting the whole job (fault_tolerance.recovery = "restart"), and the peer,
# PyTorch DDP under `torchrun --max-restarts 1` (benches/torch_ddp_restart.py).
#
# The pipeline rows run the same model as 2 replicas of 2 stages (4 ranks).
#
# The parameter-server rows run examples/ctr_ps.toml with 64-wide embeddings over 2 M ids (sync,
# 2 shards x 2 trainers, 240 steps, a checkpoint every 40; about 100 MB of tables and optimizer
# state by step 200) and lose trainer 1 or server 1 after the checkpoint of step 200; "resumed"
# is when the last role holds the checkpoint's state again (in place: the shards serve
# generation 1 and the trainers rejoined it; restarted: every process read it from disk).
#
# The job: 3 trainers on loopback, an MLP of 64-4096-4096-4096-10 (34 M parameters, 135 MB; the
# state with SGD momentum is 270 MB), a global batch of 48, 30 steps, a checkpoint every 5 steps;
# the kill lands after the checkpoint of step 10. Heartbeats every 200 ms, 5 misses.
#
# Phases, read from the processes' own log lines (one host, one clock):
#   detect      kill -> the coordinator declares rank 1 dead
#   abort       declared -> the last survivor has left its collective ("rolling back after")
#   replacement kill -> the replacement's first log line (the launcher saw the death, started it)
#   rendezvous  kill -> the coordinator's roster of generation 1 (every rank joined again)
#   ring        roster -> the last survivor has rebuilt its ring ("rejoined")
#   restore     the slowest rank's restore: survivors from memory, the replacement from disk
#               (or, with the checkpoint deleted from disk at the kill, from a peer: a node
#               that came back with an empty disk)
#   resumed     kill -> the last rank holds the checkpoint's state again
#
# Usage: benches/fault_recovery.sh [path/to/flotilla] [runs]   (default: target/release/flotilla, 3)
# The peer runs when $FLOTILLA_PEERS_VENV (../shared/peers/setup.sh) has torch.
set -euo pipefail
flotilla=${1:-target/release/flotilla}
runs=${2:-3}
work=$(mktemp -d)
launcher=
cleanup() {
    [ -n "$launcher" ] && kill -9 "$launcher" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

settings=(--set cluster.nproc_per_node=3 --set train.batch_size=48 --set train.steps=30
    --set 'train.hidden_sizes=[4096,4096,4096]' --set fault_tolerance.checkpoint_every=5
    --set fault_tolerance.max_restarts=1 --set fault_tolerance.heartbeat_interval_ms=200)

now() { date +%s.%N; }

# The pid of the child of $1 whose environment has $2=$3.
child_with() {
    for pid in $(cat /proc/"$1"/task/*/children); do
        if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "$2=$3"; then
            echo "$pid"
            return
        fi
    done
}

# Waits (at most 120 s) for file $1.
wait_for() {
    for _ in $(seq 1 12000); do
        [ -e "$1" ] && return
        sleep 0.01
    done
    echo "$1 never appeared" >&2
    exit 1
}

flotilla_run() { # mode port signal [disk_lost] [pipeline]
    local mode=$1 port=$2 signal=$3 lost=${4:-} layout=${5:-} dir="$work/$1-$2"
    local nproc=3 shape=()
    if [ -n "$layout" ]; then
        # Two replicas of a two-stage pipeline (1F1B, 4 micro-batches): rank 1 is stage 1 of replica 0.
        nproc=4
        shape=(--set cluster.nproc_per_node=4 --set strategy.pipeline=true --set strategy.hybrid_configs.dp_degree=2
            --set strategy.hybrid_configs.pp_degree=2 --set strategy.pipeline_configs.accumulate_steps=4)
    fi
    mkdir -p "$dir"
    "$flotilla" launch --nproc_per_node "$nproc" --started_port "$port" -- train --config config.toml \
        "${settings[@]}" "${shape[@]}" --set fault_tolerance.recovery="$mode" \
        --set fault_tolerance.checkpoint_dir="$dir/checkpoints" --run-dir "$dir/run" >"$dir/log" 2>&1 &
    launcher=$!
    wait_for "$dir/checkpoints/step-00000010/manifest.json"
    local victim killed
    victim=$(child_with "$launcher" PADDLE_TRAINER_ID 1)
    killed=$(now)
    kill "-$signal" "$victim"
    [ -n "$lost" ] && rm -rf "$dir/checkpoints/step-00000010"
    wait "$launcher" || { echo "the $mode job failed:"; tail -30 "$dir/log"; exit 1; }
    launcher=
    python3 - "$mode" "$killed" "$dir/log" "$signal" "$lost" "$layout" <<'EOF'
import re, sys
from datetime import datetime, timezone
mode, killed, log = sys.argv[1], float(sys.argv[2]), open(sys.argv[3]).read().splitlines()
mode = f"{mode} SIG{sys.argv[4]}{' disk lost' if sys.argv[5] else ''}{' pipeline' if sys.argv[6] else ''}"
def t(line):
    stamp = re.search(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z", line).group(1)
    return datetime.strptime(stamp[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
def after(pattern):
    return [(t(l), l) for l in log if re.search(pattern, l) and t(l) > killed]
restored = after(r"state restored")
resumed = max(x for x, _ in restored) - killed
restore = max(float(re.search(r"seconds=([\d.e-]+)", l).group(1)) for _, l in restored)
sources = sorted({re.search(r"from=\"?(\w+ ?\d*)", l).group(1) for _, l in restored})
if mode.startswith("in_place"):
    declared = after(r"rank 1 declared dead")[0][0]
    abort = max(x for x, _ in after(r"rolling back after")) - declared
    replacement = min(x for x, _ in after(r"^\[rank 1\]")) - killed
    roster = after(r"rendezvous complete.*generation=1")[0][0]
    ring = max(x for x, _ in after(r"rejoined")) - roster
    print(f"{mode:<26}: detect {declared - killed:.3f} s  abort {abort:.3f} s  replacement {replacement:.3f} s  "
          f"rendezvous {roster - killed:.3f} s  ring {ring:.3f} s  restore {restore:.3f} s ({'+'.join(sources)})  "
          f"resumed {resumed:.3f} s")
else:
    print(f"{mode:<26}: restore {restore:.3f} s ({'+'.join(sources)})  resumed {resumed:.3f} s")
EOF
}

torch_run() { # port
    local port=$1 dir="$work/torch-$1" venv=${FLOTILLA_PEERS_VENV:-$HOME/.cache/flotilla-peers}
    mkdir -p "$dir"
    "$venv/bin/torchrun" --nproc-per-node 3 --max-restarts 1 --monitor-interval 0.1 --rdzv-backend c10d \
        --rdzv-endpoint "127.0.0.1:$port" benches/torch_ddp_restart.py --dir "$dir" >"$dir/log" 2>&1 &
    launcher=$!
    for _ in $(seq 1 12000); do
        grep -q 'CHECKPOINT step=10 ' "$dir/log" 2>/dev/null && break
        sleep 0.01
    done
    local victim killed
    victim=$(child_with "$launcher" LOCAL_RANK 1)
    killed=$(now)
    kill -9 "$victim"
    wait "$launcher" || { echo "the torchrun job failed:"; tail -30 "$dir/log"; exit 1; }
    launcher=
    python3 - "$killed" "$dir/log" <<'EOF'
import re, sys
killed, log = float(sys.argv[1]), open(sys.argv[2]).read()
restored = [float(t) for t in re.findall(r"RESTORED rank=\d+ step=\d+ t=([\d.]+)", log) if float(t) > killed]
print(f"torchrun SIGKILL           : resumed {max(restored) - killed:.3f} s ({len(restored)} ranks restarted)")
EOF
}

ps_run() { # mode port victim (TRAINER or PSERVER)
    local mode=$1 port=$2 victim_role=$3 dir="$work/ps-$1-$2"
    mkdir -p "$dir"
    "$flotilla" launch-ps --server_num 2 --worker_num 2 --started_port "$port" -- train \
        --config examples/ctr_ps.toml --set train.steps=240 --set fault_tolerance.checkpoint_every=40 \
        --set train.embedding_dim=64 --set train.synthetic_vocab=2000000 \
        --set fault_tolerance.max_restarts=1 --set fault_tolerance.heartbeat_interval_ms=200 \
        --set fault_tolerance.recovery="$mode" --set fault_tolerance.checkpoint_dir="$dir/checkpoints" \
        --run-dir "$dir/run" >"$dir/log" 2>&1 &
    launcher=$!
    wait_for "$dir/checkpoints/step-00000200/manifest.json"
    local victim killed bytes
    if [ "$victim_role" = TRAINER ]; then
        victim=$(child_with "$launcher" PADDLE_TRAINER_ID 1)
    else
        victim=$(child_with "$launcher" PADDLE_PORT $((port + 1)))
    fi
    bytes=$(du -cb "$dir"/checkpoints/step-00000200/ps-* | tail -1 | cut -f1)
    killed=$(now)
    kill -9 "$victim"
    wait "$launcher" || { echo "the $mode job failed:"; tail -30 "$dir/log"; exit 1; }
    launcher=
    python3 - "$mode" "$killed" "$dir/log" "$victim_role" "$bytes" <<'EOF'
import re, sys
from datetime import datetime, timezone
mode, killed, log, role, size = sys.argv[1], float(sys.argv[2]), open(sys.argv[3]).read().splitlines(), sys.argv[4], int(sys.argv[5])
lost = "trainer 1" if role == "TRAINER" else "server 1"
def t(line):
    stamp = re.search(r"(\d{4}-\d\d-\d\dT[\d:.]+)Z", line).group(1)
    return datetime.strptime(stamp[:26], "%Y-%m-%dT%H:%M:%S.%f").replace(tzinfo=timezone.utc).timestamp()
def after(pattern):
    return [(t(l), l) for l in log if re.search(pattern, l) and t(l) > killed]
if mode == "in_place":
    declared = after(lost + r" declared dead")[0][0]
    roster = after(r"rendezvous complete.*generation=1")[0][0]
    serving = after(r"serving shard=.*generation=1")
    holding = serving + after(r"rejoined trainer=")
    restore = max(float(re.search(r"seconds=([\d.e-]+)", l).group(1)) for _, l in serving)
    print(f"ps in_place, {lost:<9}: detect {declared - killed:.3f} s  rendezvous {roster - killed:.3f} s  "
          f"slowest shard restore {restore:.3f} s  resumed {max(x for x, _ in holding) - killed:.3f} s  "
          f"(shard state {size / 1e6:.1f} MB)")
else:
    holding = after(r"listening on|resuming from checkpoint")
    print(f"ps restart, {lost:<10}: resumed {max(x for x, _ in holding) - killed:.3f} s  (shard state {size / 1e6:.1f} MB)")
EOF
}

venv=${FLOTILLA_PEERS_VENV:-$HOME/.cache/flotilla-peers}
for run in $(seq 1 "$runs"); do
    echo "run $run"
    flotilla_run in_place $((17200 + 10 * run)) KILL
    flotilla_run in_place $((17250 + 10 * run)) STOP
    flotilla_run in_place $((17350 + 10 * run)) KILL disk_lost
    flotilla_run restart $((17300 + 10 * run)) KILL
    flotilla_run in_place $((17500 + 10 * run)) KILL "" pipeline
    flotilla_run restart $((17550 + 10 * run)) KILL "" pipeline
    ps_run in_place $((17600 + 10 * run)) TRAINER
    ps_run in_place $((17650 + 10 * run)) PSERVER
    ps_run restart $((17700 + 10 * run)) TRAINER
    ps_run restart $((17750 + 10 * run)) PSERVER
    if [ -x "$venv/bin/torchrun" ]; then
        torch_run $((17400 + 10 * run))
    fi
done
