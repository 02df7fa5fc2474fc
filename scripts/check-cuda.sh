#!/usr/bin/env bash
# Compiles the `cuda` feature where there is no GPU, so that GPU code cannot rot:
#
#   scripts/check-cuda.sh          type-checks and lints (clippy -D warnings) every target with
#                                  --features cuda, against the real candle, cudarc and NVML
#                                  crates; candle's own CUDA kernels are left uncompiled
#                                  (scripts/nvcc-stand-in): our changes cannot break them, and
#                                  compiling them takes about 15 minutes on two cores. What CI runs.
#   scripts/check-cuda.sh --full   the same with the real nvcc (scripts/cuda-toolchain.sh), kernels
#                                  included: what a candle or cudarc upgrade must pass.
#
# Each mode builds in a folder of its own (target/cuda-check, target/cuda), so the stand-in's
# empty kernels never reach a binary that would run.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
    "")
        export CARGO_TARGET_DIR="${CARGO_TARGET_DIR_CUDA_CHECK:-$PWD/target/cuda-check}"
        export NVCC="$PWD/scripts/nvcc-stand-in"
        # cudarc reads the CUDA version from here instead of asking nvcc.
        export CUDARC_CUDA_VERSION=13000
        export CUDA_COMPUTE_CAP=90
        ;;
    --full)
        eval "$(scripts/cuda-toolchain.sh)"
        export CARGO_TARGET_DIR="$PWD/target/cuda"
        ;;
    *)
        echo "usage: $0 [--full]" >&2
        exit 2
        ;;
esac
cargo clippy --release --all-targets --features cuda -- -D warnings
