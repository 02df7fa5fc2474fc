#!/usr/bin/env bash
# Installs the CUDA build tools the `cuda` feature needs (nvcc and the CUDA headers, and with
# --libs the libraries a `cuda` binary links against) from NVIDIA's wheels on PyPI into a cache
# folder, and prints the environment a build needs:
#
#   eval "$(scripts/cuda-toolchain.sh)"            # nvcc + headers: enough for `cargo check`
#   eval "$(scripts/cuda-toolchain.sh --libs)"     # + cuBLAS, cuRAND, NVRTC, NCCL: `cargo build`
#
# A `cuda` binary links the CUDA driver (libcuda.so.1), which comes with the NVIDIA driver, not
# with a toolkit. On a machine without the driver, --libs writes a link-time stub of it (every
# driver function cudarc declares, each returning CUDA_ERROR_STUB_LIBRARY, under the soname
# libcuda.so.1): the binary then links here and loads the real driver on the GPU machine, as
# NVIDIA's own stubs are used.
#
# No root, no system CUDA. The versions are pinned to CUDA 13.0, the oldest CUDA 13 (drivers
# >= 580 run it); FLOTILLA_CUDA_HOME chooses the folder. Progress goes to stderr.
set -euo pipefail

CUDA_VERSION=13.0
TOOL_WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
LIB_WHEELS=(nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88
    nvidia-nccl-cu13==2.28.7)

with_libs=false
case "${1:-}" in
    --libs) with_libs=true ;;
    "") ;;
    *) echo "usage: $0 [--libs]" >&2; exit 2 ;;
esac

home="${FLOTILLA_CUDA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/flotilla-cuda/$CUDA_VERSION}"

# Unpacks `stamp`'s wheels into $home once; a folder left by an interrupted run is redone.
install_wheels() {
    local stamp="$home/.installed-$1"; shift
    [[ -f "$stamp" ]] && return 0
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    echo "cuda-toolchain: downloading $* into $home" >&2
    python3 -m pip download --quiet --no-deps --only-binary :all: --dest "$work/wheels" "$@" >&2
    for wheel in "$work"/wheels/*.whl; do
        python3 -m zipfile -e "$wheel" "$work/unpacked" >&2
    done
    mkdir -p "$home"
    # Every wheel puts its files under nvidia/cu13/ (NCCL under nvidia/nccl/).
    for tree in "$work"/unpacked/nvidia/*/; do
        cp -a "$tree". "$home/"
    done
    chmod -R u+x "$home/bin" "$home/nvvm/bin" 2>/dev/null || true
    touch "$stamp"
}

# The link-time stand-in for the driver, in $home/stubs (see the top of this file).
write_driver_stub() {
    local stubs="$home/stubs"
    [[ -f "$stubs/libcuda.so" ]] && return 0
    local bindings
    bindings="$(ls "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | tail -n 1)"
    if [[ -z "$bindings" ]]; then
        echo "cuda-toolchain: cudarc's sources are not fetched yet; run \`cargo fetch\` first" >&2
        exit 1
    fi
    mkdir -p "$stubs"
    grep -oE '^\s+fn cu[A-Za-z0-9_]+\(' "$bindings" | sed -E 's/^\s+fn //; s/\($//' | sort -u |
        sed 's/.*/int &(void) { return 34; }/' >"$stubs/libcuda.c"
    cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda.c"
    echo "cuda-toolchain: no NVIDIA driver here; linking against the stub $stubs/libcuda.so" >&2
}

install_wheels tools "${TOOL_WHEELS[@]}"
"$home/bin/nvcc" --version >/dev/null || { echo "cuda-toolchain: $home/bin/nvcc does not run" >&2; exit 1; }
if $with_libs; then
    install_wheels libs "${LIB_WHEELS[@]}"
    # The linker looks for libX.so; the wheels carry only the sonames.
    for lib in "$home"/lib/lib*.so.*; do
        unversioned="${lib%%.so.*}.so"
        [[ -e "$unversioned" ]] || ln -s "$(basename "$lib")" "$unversioned"
    done
    if ! /sbin/ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; then
        write_driver_stub
    fi
fi

# CUDA_COMPUTE_CAP: there is no GPU to ask at build time; 90 is the H100/H200.
cat <<ENV
export CUDA_HOME='$home' CUDA_ROOT='$home' CUDA_PATH='$home'
export PATH='$home/bin':"\$PATH"
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
export LIBRARY_PATH='$home/lib:$home/stubs':"\${LIBRARY_PATH:-}"
export LD_LIBRARY_PATH='$home/lib':"\${LD_LIBRARY_PATH:-}"
ENV
