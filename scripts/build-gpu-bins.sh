#!/usr/bin/env bash
# Builds the CUDA test binaries and the `ragged` CLI (feature cuda) on a machine with a Rust toolchain (no GPU or CUDA needed) and
# copies them, under stable names, to target/gpu-bin/ for scripts/gpu-check.sh to run on a GPU
# machine that has no Rust toolchain. Carry target/gpu-bin with the working tree.
#
#   scripts/build-gpu-bins.sh
#
# Equivalent by hand: `cargo test --features cuda --no-run --test cuda_tests` and
# `cargo test -p ragged-optimizers --features cuda --no-run --test cuda_tests`; cargo prints
# each binary's path (target/debug/deps/cuda_tests-<hash>). The test profile is already
# optimized (opt-level 3, see Cargo.toml), so this reuses the `cargo test` build; the copies are
# stripped of debug info to keep them small enough to carry.
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/gpu-bin
mkdir -p "$out"
build() { # <name> <cargo args...>
    local name=$1
    shift
    local exe
    exe=$(cargo test --features cuda --no-run --message-format=json "$@" 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_tests":
        print(m["executable"])' | tail -n 1)
    if [[ -z "$exe" ]]; then
        echo "build-gpu-bins: no test binary for $name" >&2
        exit 1
    fi
    cp "$exe" "$out/$name"
    strip "$out/$name" 2>/dev/null || true
    echo "$out/$name <- $exe ($(du -h "$out/$name" | cut -f1))"
}
build ragged-cuda-tests -p ragged --test cuda_tests
build optimizers-cuda-tests -p ragged-optimizers --test cuda_tests
# The CLI (`ragged bench optim --device cuda`) and the training example (`--comm gpu-threads`,
# `--comm nccl`).
cargo build --release -p ragged-cli --features cuda
cargo build --release -p ragged --example train --features cuda
for exe in target/release/ragged target/release/examples/train; do
    cp "$exe" "$out/$(basename "$exe")"
    strip "$out/$(basename "$exe")" 2>/dev/null || true
    echo "$out/$(basename "$exe") <- $exe ($(du -h "$out/$(basename "$exe")" | cut -f1))"
done
