# Source this (bash) to build the `candle-cuda` feature on a machine without a CUDA toolkit:
#
#   source scripts/candle-cuda-env.sh [dir]      # default dir: ${TMPDIR:-/tmp}/ragged-cu13
#   cargo check --workspace --all-targets --features ragged/candle-cuda,ragged-optimizers/cuda
#
# candle's CUDA backend compiles its kernels with nvcc at build time and its cudarc asks nvcc
# for the CUDA version. nvcc 13.0 and the headers it needs come from PyPI wheels (about 100 MB,
# fetched once into `dir`); no GPU is needed to build. CUDA_COMPUTE_CAP=90 (H100/H200) is the
# architecture candle's kernels are compiled for; CUDARC_CUDA_VERSION pins cudarc to CUDA 13.0,
# the version of the GPU test machine (and of the `cuda-13000` feature ragged uses).
#
# Linking a binary needs the CUDA libraries (candle links them dynamically): where they are
# missing, link-only stubs (scripts/cuda-link-stubs.sh) go into $CUDA_ROOT/lib beside the
# wheel's CUDA runtime (a folder cudarc's build script always finds: it lists only folders that
# exist when it runs), so binaries link here and load the real libraries on a GPU machine.
ragged_cu13=${1:-${TMPDIR:-/tmp}/ragged-cu13}
if [[ ! -x $ragged_cu13/x/nvidia/cu13/bin/nvcc ]]; then
    mkdir -p "$ragged_cu13/whl" &&
        python3 -m pip download --quiet --no-deps -d "$ragged_cu13/whl" \
            nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 \
            nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85 &&
        for w in "$ragged_cu13"/whl/*.whl; do python3 -m zipfile -e "$w" "$ragged_cu13/x"; done &&
        chmod +x "$ragged_cu13"/x/nvidia/cu13/bin/* "$ragged_cu13"/x/nvidia/cu13/nvvm/bin/*
fi
if [[ -x $ragged_cu13/x/nvidia/cu13/bin/nvcc ]]; then
    export CUDA_ROOT=$ragged_cu13/x/nvidia/cu13
    export CUDA_HOME=$CUDA_ROOT CUDA_PATH=$CUDA_ROOT PATH=$CUDA_ROOT/bin:$PATH
    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} CUDARC_CUDA_VERSION=13000
    # cudaforge (candle's kernel builder) runs nvcc on half the cores unless told otherwise: one
    # of two here, 12-14 min per build of candle's kernels. Not a rerun trigger of its build.
    export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
    # candle's MoE kernels are a static library that calls the CUDA runtime: link the wheel's.
    [[ -e $CUDA_ROOT/lib/libcudart.so ]] || ln -sf libcudart.so.13 "$CUDA_ROOT/lib/libcudart.so"
    if [[ ! -e $CUDA_ROOT/lib/libnccl.so.2 ]]; then
        "$(dirname "${BASH_SOURCE[0]}")/cuda-link-stubs.sh" "$CUDA_ROOT/lib" >/dev/null ||
            echo "candle-cuda-env: no link stubs; binaries will not link without CUDA" >&2
    fi
    echo "candle-cuda build environment: $("$CUDA_ROOT/bin/nvcc" --version | tail -n 2 | head -n 1)"
else
    echo "candle-cuda-env: could not fetch nvcc from PyPI into $ragged_cu13" >&2
    false
fi
