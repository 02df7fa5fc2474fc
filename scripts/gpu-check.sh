#!/usr/bin/env bash
# The GPU check: what CI cannot run, on a machine with one NVIDIA GPU, in under 5 minutes once
# the binary exists. Writes every figure to one JSON file and exits non-zero if a check fails.
#
#   scripts/gpu-check.sh [OUT.json]                     # builds target/cuda/release/flotilla (--features cuda)
#   FLOTILLA_BIN=path/flotilla scripts/gpu-check.sh     # a `cuda` binary built elsewhere
#
# A binary built elsewhere travels lighter without its debug sections (157 MB → 65 MB):
#   objcopy --strip-debug target/release/flotilla flotilla-cuda
#
# Checks:
#   1. the digits MLP and the GPT, one rank on the GPU, against the same jobs on the CPU: every
#      step's loss within TOLERANCE (relative). Both run in f32; the GPU sums in other orders
#      (cuBLAS tiles, parallel reductions), a relative difference of ~1e-6 per operation that
#      training grows slowly; a wrong gradient or a stale bucket is off by far more at once.
#   2. two data-parallel ranks sharing the GPU (their gradients go through the host ring, as
#      NCCL refuses two ranks on one device) against two CPU ranks, same tolerance;
#   3. NCCL: `bench allreduce --backend nccl` with two processes on the GPU (NCCL is expected to
#      refuse, and its refusal must be a readable error) and with one (the single-rank path);
#   4. GPU utilisation and memory in metrics.jsonl (NVML), on a GPT large enough to load it.
#
# Needs at run time: the NVIDIA driver (CUDA 13: driver >= 580), and cuBLAS, cuRAND, NVRTC,
# NCCL and the CUDA runtime 13 where the loader finds them (LD_LIBRARY_PATH; the wheels of
# scripts/cuda-toolchain.sh --libs hold them all).
set -euo pipefail
# Paths given are the caller's; the jobs' configs are the repository's.
out_json="$(realpath -m "${1:-gpu-check.json}")"
bin="${FLOTILLA_BIN:+$(realpath "$FLOTILLA_BIN")}"
cd "$(dirname "$0")/.."

TOLERANCE=1e-3
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

say() { echo "gpu-check: $*" >&2; }

if [[ -z "$bin" ]]; then
    eval "$(scripts/cuda-toolchain.sh --libs)"
    # Beside the CPU build, as check-cuda.sh --full, so neither rebuilds the other.
    CARGO_TARGET_DIR="$PWD/target/cuda" cargo build --release --features cuda >&2
    bin="$PWD/target/cuda/release/flotilla"
fi
missing="$(ldd "$bin" | awk '/not found/ {print $1}' | tr '\n' ' ')"
if [[ -n "$missing" ]]; then
    say "$bin cannot start: the loader finds no $missing— put their folder on LD_LIBRARY_PATH"
    exit 1
fi
if ! command -v nvidia-smi >/dev/null; then
    say "nvidia-smi is missing: no NVIDIA driver on this machine"
    exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >"$work/gpu.csv"
say "GPU: $(cat "$work/gpu.csv")"
started=$SECONDS
"$bin" doctor --set cluster.device=gpu >"$work/doctor.txt" 2>&1 || true

# train NAME DEVICE ARGS...: one job into $work/NAME, bounded in time (under `flotilla launch`
# when LAUNCHER holds its arguments); its exit status is kept.
LAUNCHER=()
train() {
    local name="$1" device="$2"
    shift 2
    say "train $name on $device"
    local status=0
    timeout 150 "$bin" "${LAUNCHER[@]}" train --run-dir "$work/$name" --set "cluster.device=$device" "$@" \
        >"$work/$name.log" 2>&1 || status=$?
    echo "$status" >"$work/$name.status"
    [[ $status -eq 0 ]] || { say "$name failed ($status):"; tail -5 "$work/$name.log" >&2; }
}

MLP=(--config config.toml --set train.epochs=3 --set train.log_every=1000)
GPT=(--config examples/gpt.toml --set train.steps=30 --set train.log_every=1000)
ONE=(--set cluster.nproc_per_node=1)

train mlp-cpu cpu "${MLP[@]}" "${ONE[@]}"
train mlp-gpu gpu "${MLP[@]}" "${ONE[@]}"
train gpt-cpu cpu "${GPT[@]}" "${ONE[@]}"
train gpt-gpu gpu "${GPT[@]}" "${ONE[@]}"
train dp2-cpu cpu "${MLP[@]}" --set cluster.nproc_per_node=2
# Both ranks on GPU 0 (without it, rank 1 would ask for a second GPU).
export FLAGS_selected_gpus=0
train dp2-gpu gpu "${MLP[@]}" --set cluster.nproc_per_node=2
unset FLAGS_selected_gpus
# One process under the launcher, which hands it FLAGS_selected_gpus=0.
LAUNCHER=(launch --nproc_per_node 1 --started_port 29170 --)
train mlp-launched-gpu gpu "${MLP[@]}" "${ONE[@]}"
LAUNCHER=()
train gpt-large-gpu gpu --config examples/gpt.toml \
    --set train.steps=150 --set train.batch_size=64 --set train.gpt.n_layer=8 \
    --set train.gpt.n_embd=512 --set train.gpt.n_head=8 --set train.gpt.block_size=128 \
    --set train.log_every=50

# bench NAME NPROC: the NCCL all-reduce benchmark, figures as JSON lines.
bench() {
    local name="$1" nproc="$2"
    say "bench allreduce --backend nccl --nproc $nproc"
    local status=0
    timeout 120 "$bin" bench allreduce --backend nccl --nproc "$nproc" --size-mb 1,16,64,256 --iters 20 \
        --json >"$work/$name.jsonl" 2>"$work/$name.log" || status=$?
    echo "$status" >"$work/$name.status"
}
bench nccl-2proc-1gpu 2
bench nccl-1proc 1

python3 - "$work" "$out_json" "$TOLERANCE" "$((SECONDS - started))" <<'PY'
import json, pathlib, sys

work, out, tol, seconds = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])

def status(name):
    return int((work / f"{name}.status").read_text())

def losses(name):
    path = work / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

def compare(cpu, gpu):
    a, b = losses(cpu), losses(gpu)
    if status(cpu) or status(gpu) or not a or len(a) != len(b):
        return {"ok": False, "why": f"runs failed or differ in length ({len(a)} vs {len(b)} steps)"}
    worst = max(abs(x["loss"] - y["loss"]) / max(abs(x["loss"]), 1e-6) for x, y in zip(a, b))
    return {"ok": worst <= tol, "steps": len(a), "max_relative_loss_difference": worst,
            "final_loss_cpu": a[-1]["loss"], "final_loss_gpu": b[-1]["loss"],
            "samples_per_sec_cpu": a[-1]["samples_per_sec"], "samples_per_sec_gpu": b[-1]["samples_per_sec"]}

def gpu_figures(name):
    every = losses(name)
    lines = every[10:]  # past the warm-up
    util = [l["gpu_utilization"] for l in lines if l.get("gpu_utilization") is not None]
    mem = [l["gpu_memory_bytes"] for l in lines if l.get("gpu_memory_bytes") is not None]
    return {"ok": status(name) == 0 and bool(util) and bool(mem), "steps": len(every),
            "mean_gpu_utilization_percent": sum(util) / len(util) if util else None,
            "utilization_above_85_percent": bool(util) and sum(util) / len(util) > 85,
            "max_gpu_memory_bytes": max(mem) if mem else None,
            "samples_per_sec": lines[-1]["samples_per_sec"] if lines else None}

def bench(name):
    rows = [json.loads(l) for l in (work / f"{name}.jsonl").read_text().splitlines() if l.startswith("{")]
    log = (work / f"{name}.log").read_text().strip().splitlines()
    errors = [l for l in log if "error" in l.lower()]
    return {"exit_status": status(name), "figures": rows, "error": errors[-1] if errors else None}

report = {
    "gpu": (work / "gpu.csv").read_text().strip(),
    "seconds": seconds,
    "doctor": [l for l in (work / "doctor.txt").read_text().splitlines() if "device" in l],
    "tolerance_relative": tol,
    "mlp_one_gpu_vs_cpu": compare("mlp-cpu", "mlp-gpu"),
    "gpt_one_gpu_vs_cpu": compare("gpt-cpu", "gpt-gpu"),
    "mlp_launched_gpu_vs_cpu": compare("mlp-cpu", "mlp-launched-gpu"),
    "data_parallel_2_ranks_shared_gpu_vs_cpu": compare("dp2-cpu", "dp2-gpu"),
    "gpt_large_gpu": gpu_figures("gpt-large-gpu"),
    "nccl_allreduce_2_processes_1_gpu": bench("nccl-2proc-1gpu"),
    "nccl_allreduce_1_process": bench("nccl-1proc"),
}
two, one = report["nccl_allreduce_2_processes_1_gpu"], report["nccl_allreduce_1_process"]
# Two ranks on one GPU: NCCL either runs them or refuses with an error that names NCCL.
two["ok"] = bool(two["figures"]) if two["exit_status"] == 0 else bool(two["error"] and "NCCL" in two["error"])
one["ok"] = one["exit_status"] == 0 and len(one["figures"]) == 4
checks = [v for v in report.values() if isinstance(v, dict) and "ok" in v]
report["passed"] = all(c["ok"] for c in checks)
pathlib.Path(out).write_text(json.dumps(report, indent=2) + "\n")
print(json.dumps(report, indent=2))
sys.exit(0 if report["passed"] else 1)
PY
