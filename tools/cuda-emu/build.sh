#!/usr/bin/env bash
# Builds cuda-emu (CPU stand-ins for libcuda.so.1, libcublas.so.13 and libnccl.so.2; see
# driver.cpp, cublas.cpp, nccl.cpp) into
# DIR (default target/cuda-emu), after checking that kernels.cpp emulates exactly the entries
# of kernels/*.cu. Use: LD_LIBRARY_PATH=DIR:<NVRTC lib dir> cargo test --features cuda ...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../target/cuda-emu}
mkdir -p "$out"
declared=$(grep -hoE '__global__ void (__launch_bounds__\([^)]*\) )?[a-z0-9_]+' "$here"/../../kernels/*.cu |
    awk '{print $NF}' | sort)
emulated=$(grep -o '^ *ENTRY([a-z_0-9]*, [a-z_0-9]*' "$here/kernels.cpp" | awk '{print $2}' | sort)
if [[ $declared != "$emulated" ]]; then
    echo "tools/cuda-emu/kernels.cpp does not list the entries of kernels/*.cu:" >&2
    diff <(echo "$declared") <(echo "$emulated") >&2 || true
    exit 1
fi
# -fsanitize=alignment: a kernel's misaligned vector access (a float4 at an address that is
# no multiple of 16), which faults on a GPU, aborts here instead of working by luck on x86.
flags=(-std=c++17 -O2 -fPIC -shared -ffp-contract=off -fno-fast-math -Wall -Wno-unused-function -Wno-unknown-pragmas
    -fsanitize=alignment -fno-sanitize-recover=alignment)
c++ "${flags[@]}" -o "$out/libcuda.so.1" "$here/driver.cpp" "$here/kernels.cpp"
ln -sf libcuda.so.1 "$out/libcuda.so"
c++ "${flags[@]}" -o "$out/libcublas.so.13" "$here/cublas.cpp" -L"$out" -l:libcuda.so.1
ln -sf libcublas.so.13 "$out/libcublas.so"
c++ "${flags[@]}" -o "$out/libnccl.so.2" "$here/nccl.cpp" -L"$out" -l:libcuda.so.1 -pthread
ln -sf libnccl.so.2 "$out/libnccl.so"
echo "$out"
