#!/usr/bin/env bash
# Builds the CUDA test binaries, the `ragged` CLI and the training example on a machine with a
# Rust toolchain (no GPU or CUDA needed) and copies them, under stable names, to target/gpu-bin/
# for scripts/gpu-check.sh to run on a GPU machine that has no Rust toolchain. Carry
# target/gpu-bin with the working tree.
#
#   scripts/build-gpu-bins.sh
#
# Two builds:
# - feature `cuda` (ragged's kernels, cuBLAS, NCCL; cudarc loads the libraries at run time, so
#   these binaries start anywhere and their tests skip without a GPU): ragged-cuda-tests,
#   optimizers-cuda-tests, ragged, train;
# - feature `candle-cuda` (candle's own CUDA backend: the model itself on the GPU), when nvcc
#   can be fetched (scripts/candle-cuda-env.sh): optimizers-candle-cuda-tests,
#   ragged-candle-cuda, train-candle-cuda. candle links the CUDA libraries, so these start only
#   where they are installed; here they link against stubs (scripts/cuda-link-stubs.sh).
#
# Each feature builds once: one package selection (the workspace, the feature on every
# package that has it) and one profile (release) for the test binaries, the CLI and the
# example, so cargo resolves one feature set and, for candle-cuda, runs nvcc on candle's
# kernels once (each other selection or profile rebuilds them: 5-14 min each). By hand:
# `cargo test --release --workspace --features ragged/cuda,ragged-optimizers/cuda,ragged-cli/cuda
# --no-run --test cuda_tests` prints each package's binary (target/release/deps/cuda_tests-<hash>).
# The copies are stripped and xz-compressed to fit the carry (the candle-cuda ones are some
# 55 MB stripped, 13-15 MB compressed: candle's kernels as PTX).
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-bin
rm -rf "$out"
mkdir -p "$out"
keep() { # <source> <name>: stripped and xz-compressed (gpu-check.sh unpacks them)
    cp "$1" "$out/$2"
    strip "$out/$2" 2>/dev/null || true
    local size
    size=$(du -h "$out/$2" | cut -f1)
    xz -9 -T0 -f "$out/$2"
    echo "$out/$2.xz <- $1 ($size stripped, $(du -h "$out/$2.xz" | cut -f1) compressed)"
}
features() { # <feature>: the feature on each workspace package that has it
    echo "ragged/$1,ragged-optimizers/$1,ragged-cli/$1"
}
test_bin() { # <name> <package> <feature>: the package's cuda_tests
    local exe
    exe=$(cargo test --release --workspace --features "$(features "$3")" --test cuda_tests \
        --no-run --message-format=json 2>/dev/null | python3 scripts/test_exe.py cuda_tests "$2")
    if [[ -z "$exe" ]]; then
        echo "build-gpu-bins: no test binary for $1 (package $2, feature $3)" >&2
        exit 1
    fi
    keep "$exe" "$1"
}
release_bins() { # <suffix> <feature>: the CLI (`ragged bench optim|train --device cuda`) and
    # the training example (`--comm gpu-threads`, `--comm nccl`, `--device cuda`).
    cargo build --release --workspace --features "$(features "$2")" --bin ragged --example train
    keep target/release/ragged "ragged$1"
    keep target/release/examples/train "train$1"
}
test_bin ragged-cuda-tests ragged cuda
test_bin optimizers-cuda-tests ragged-optimizers cuda
release_bins "" cuda
if source scripts/candle-cuda-env.sh; then
    test_bin optimizers-candle-cuda-tests ragged-optimizers candle-cuda
    release_bins -candle-cuda candle-cuda
else
    echo "build-gpu-bins: no nvcc, so no candle-cuda binaries (the model stays on the CPU)" >&2
    rm -f "$out"/*candle-cuda*.xz
fi
# The builds above share target/release with the usual ones: say so, since the last of them
# (candle-cuda, linked against stubs) cannot start on a machine without CUDA.
echo "build-gpu-bins: target/release/ragged and examples/train are now GPU builds;" \
    "\`cargo build --release --workspace --bins --examples\` makes the CPU ones again" >&2
# What travels to the GPU machine (the working tree with target/gpu-bin) is limited to 64 MiB.
total=$(du -sm "$out" | cut -f1)
echo "$out: $total MiB"
if ((total > 48)); then
    echo "build-gpu-bins: $out is $total MiB; with the working tree it may pass the 64 MiB" \
        "that travels to the GPU machine (drop a binary from the carry)" >&2
fi
