#!/usr/bin/env bash
# Kernel A/B on a GPU machine without a Rust toolchain (the binaries of
# scripts/build-gpu-bins.sh in target/gpu-bin, carried with the working tree):
#
#   scripts/gpu-kernel-variants.sh [-k ENTRY] DIR...   # results in $OUT, else ./gpu-results
#
# DIR is a copy of kernels/ with edits (carry it too). First the built-in kernels, the same-run
# baseline, then each DIR through RAGGED_KERNEL_DIR (src/cuda/imp.rs): the optimizers' CUDA
# tests (bitwise against the CPU step), `ragged bench optim --device cuda` twice (its rows with
# their same-run memcpy and GEMM baselines), nvcc's register and spill count of DIR's
# adam8bit.cu when nvcc is there, and with Nsight Compute one profile of the first ENTRY launch
# after two (default adam8bit_blocks) into ncu-<n>.txt. Everything said goes to variants.log.
set -uo pipefail
cd "$(dirname "$0")/.."
entry=adam8bit_blocks
if [[ ${1:-} == -k ]]; then
    entry=$2
    shift 2
fi
dest=${OUT:-gpu-results}
mkdir -p "$dest"
log=$dest/variants.log
: >"$log"
say() { echo "$*" | tee -a "$log"; }
work=$(mktemp -d)
bins=target/gpu-bin unpacked=$work/bin links=$work/links
mkdir -p "$unpacked" "$links"
# shellcheck source=scripts/gpu-env.sh
source scripts/gpu-env.sh >/dev/null || exit 2
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null | head -n 1)
n=0
for dir in built-in "$@"; do
    if [[ $dir == built-in ]]; then
        unset RAGGED_KERNEL_DIR
    else
        export RAGGED_KERNEL_DIR=$dir
        [[ -n $nvcc && -e $dir/adam8bit.cu ]] &&
            "$nvcc" --cubin -arch=sm_90 -Xptxas -v -fmad=false -prec-div=true -prec-sqrt=true \
                -ftz=false -o "$work/k.cubin" "$dir/adam8bit.cu" 2>&1 | grep -E 'registers|spill' |
            tee -a "$log"
    fi
    say "== $n: $dir"
    timeout 150 "$bins/optimizers-cuda-tests" --test-threads=1 >"$work/tests.txt" 2>&1
    say "tests: exit $? $(grep 'test result' "$work/tests.txt")"
    grep -E 'FAILED|panicked' "$work/tests.txt" | head -n 5 | tee -a "$log"
    for _ in 1 2; do
        timeout 90 "$bins/ragged" bench optim --device cuda --out - 2>/dev/null | grep '^| ' |
            tee -a "$log"
    done
    if [[ -n $ncu ]]; then
        timeout 120 "$ncu" --clock-control none -k "$entry" -s 2 -c 1 --section SpeedOfLight \
            --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
            --section WarpStateStats --metrics smsp__thread_inst_executed.sum \
            "$bins/ragged" bench optim --device cuda --out - >"$dest/ncu-$n.txt" 2>&1
        say "ncu: exit $? (ncu-$n.txt)"
    fi
    n=$((n + 1))
done
rm -rf "$work"
say "done in $SECONDS s"
