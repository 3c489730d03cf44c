#!/usr/bin/env bash
# Makes link-only stand-ins for the CUDA libraries that candle's backend links (feature
# candle-cuda), so its binaries link on a machine without CUDA and run where CUDA is installed.
#
#   scripts/cuda-link-stubs.sh DIR
#
# candle turns on cudarc's `dynamic-linking`: every binary then names libcuda, cuBLAS, cuBLASLt,
# cuRAND, NCCL and NVRTC at link time. The CUDA toolkit ships such stubs for the driver only; the
# pip wheels hold the real libraries (hundreds of MB, and never libcuda). Each stub here defines
# every function cudarc declares for its library, under the real library's soname, so a binary
# linked against it loads the real library at run time. The names come from the cudarc sources
# this workspace builds with (cargo metadata).
#
# Put on the loader path (`LD_LIBRARY_PATH=DIR`, as .ci/run does), the stubs act as a driver
# that sees no GPU: every driver function returns CUDA_ERROR_NO_DEVICE (100), so the gates
# (`cuda::Device::open`, candle's device creation) return their error and the tests skip with a
# printed reason. The other libraries are reached only through a device, so their stubs say
# so and abort if ever called; none returns a fake success.
set -euo pipefail
out=${1:?usage: scripts/cuda-link-stubs.sh DIR}
cd "$(dirname "$0")/.."
cudarc=$(cargo metadata --format-version 1 --features ragged/candle-cuda 2>/dev/null | python3 -c 'import json, os, sys
meta = json.load(sys.stdin)
print(next(os.path.dirname(p["manifest_path"]) for p in meta["packages"] if p["name"] == "cudarc"))')
mkdir -p "$out"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
# <library> <soname> <cudarc sys module>: sonames of CUDA 13, the version cudarc is pinned to.
while read -r lib soname module; do
    c=$src/$lib.c
    {
        echo '#include <stdio.h>'
        echo '#include <stdlib.h>'
        if [[ $lib == cuda ]]; then
            echo '#define STUB(f) int f(void) { return 100; /* CUDA_ERROR_NO_DEVICE */ }'
        else
            echo "#define STUB(f) void f(void) { fprintf(stderr, \"%s: link-only stub of $soname called;\" \\"
            echo "    \" put the real CUDA library on the loader path\\n\", #f); abort(); }"
        fi
        grep -ho '^pub unsafe fn [A-Za-z0-9_]*' "$cudarc/src/$module/sys/mod.rs" |
            awk '{print "STUB(" $4 ")"}' | sort -u
    } >"$c"
    gcc -shared -fPIC -O0 -Wl,-soname,"$soname" -o "$out/lib$lib.so" "$c"
    ln -sf "lib$lib.so" "$out/$soname"
done <<'EOF'
cuda libcuda.so.1 driver
cublas libcublas.so.13 cublas
cublasLt libcublasLt.so.13 cublaslt
curand libcurand.so.10 curand
nccl libnccl.so.2 nccl
nvrtc libnvrtc.so.13 nvrtc
EOF
echo "link-only CUDA stubs in $out: $(cd "$out" && ls lib*.so | tr '\n' ' ')"
