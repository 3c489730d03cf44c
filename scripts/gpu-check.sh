#!/usr/bin/env bash
# One prepared check for a GPU machine without a Rust toolchain (see README "GPU").
#
#   scripts/gpu-check.sh [results-dir]     # default: $OUT, else ./gpu-results
#
# The results dir receives four files (the device tool brings back at most 8 from $OUT):
# gpu-check.log (everything said, each test's lines, the benchmark tables), machine.txt,
# benchmarks.md (docs/benchmarks.md with the GPU sections filled in) and gpu-results.tgz (every
# output file: each test binary's full output, bench-*.md and .log, train-*.txt).
#   RAGGED_EXPECT_GPU=1 scripts/gpu-check.sh   # exit 3 if any test skipped for want of a GPU
#   RAGGED_GPU_CHECK_SECONDS=480 scripts/gpu-check.sh   # the whole check's time (default 480)
#
# Runs the CUDA test binaries that scripts/build-gpu-bins.sh built elsewhere and left in
# target/gpu-bin/ (carry that folder with the working tree), then `ragged bench optim --device
# cuda` into bench-optim.md and the optim-cuda section of a copy of docs/benchmarks.md, then
# (with the candle-cuda binaries) `ragged bench train --device cuda` into bench-train.md and
# section train-cuda, and `train --device cuda` on thread ranks (with every optimizer), on a
# one-process NCCL world and saved then resumed from a checkpoint (on the GPU and on the CPU).
# CUDA libraries: the driver (libcuda.so.1) must be installed; cuBLAS(Lt), cuRAND, NVRTC and
# NCCL are taken from pip wheels (nvidia-cublas, nvidia-curand, nvidia-cuda-nvrtc,
# nvidia-nccl-cu13) when any are installed, else from the system (CUDA toolkit on the loader
# path). NCCL's soname is libnccl.so.2, which cudarc does not search for, so a libnccl.so
# symlink is made in a private folder put first on LD_LIBRARY_PATH.
# Nothing is downloaded: the machine may have no network.
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${1:-${OUT:-gpu-results}}
mkdir -p "$dest"
work=$(mktemp -d)
res=$work/gpu-results   # every output; packed into $dest on exit (see the trap below)
mkdir -p "$res"
bins=target/gpu-bin
log="$res/gpu-check.log"
: >"$log"
say() { echo "$*" | tee -a "$log"; }
# One deadline for the whole check (a lease is 15 minutes, machine start included), and a cap
# per step, so that a step that hangs costs its cap and the steps after it still run.
deadline=$((SECONDS + ${RAGGED_GPU_CHECK_SECONDS:-480}))
limited() { # <cap seconds> <command...>: the command under timeout min(cap, time left)
    local left=$((deadline - SECONDS)) cap=$1 start=$SECONDS rc=0
    shift
    if ((left < 10)); then
        echo "out of time: not run: $*" >&2
        return 124
    fi
    # -k: a process wedged in the driver may ignore SIGTERM.
    timeout -k 10 $((cap < left ? cap : left)) "$@" || rc=$?
    echo "[$((SECONDS - start)) s]" >>"$log"
    return $rc
}

links=$work/links      # the libnccl.so link (below)
unpacked=$work/bin     # the unpacked binaries
ids=$work/ids          # NCCL id files of the one-process worlds
mkdir -p "$links" "$unpacked" "$ids"
deliver() {
    cp "$log" "$dest/gpu-check.log"
    [[ -e $res/machine.txt ]] && cp "$res/machine.txt" "$dest/"
    [[ -e $res/benchmarks.md ]] && cp "$res/benchmarks.md" "$dest/"
    tar czf "$dest/gpu-results.tgz" -C "$work" gpu-results
    rm -rf "$work"
}
trap deliver EXIT

if [[ ! -d $bins ]]; then
    say "no $bins: run scripts/build-gpu-bins.sh on a machine with cargo and carry $bins"
    exit 2
fi

# --- CUDA libraries: scripts/gpu-env.sh -------------------------------------------------------
# shellcheck source=scripts/gpu-env.sh
source scripts/gpu-env.sh || exit 2

# --- The machine -----------------------------------------------------------------------------
{
    echo "== date"; date -u
    echo "== nvidia-smi"; nvidia-smi 2>&1 || echo "nvidia-smi not available"
    echo "== libraries"; for l in libcuda.so.1 libcublas.so.13 libcublasLt.so.13 libcurand.so.10 \
        libnvrtc.so.13 libnccl.so libnccl.so.2; do
        printf '%s: ' "$l"
        python3 -c "import ctypes,sys; ctypes.CDLL(sys.argv[1]); print('loads')" "$l" 2>&1 | tail -n 1
    done
    # NVRTC's PTX loads only on a driver of the same CUDA release or newer.
    echo "== versions"
    python3 - <<'PY' 2>&1 || echo "version probe failed"
import ctypes
major, minor, drv = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
ctypes.CDLL("libnvrtc.so.13").nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(drv))
print(f"NVRTC {major.value}.{minor.value}; driver CUDA {drv.value // 1000}.{drv.value % 1000 // 10}")
PY
    # Does the driver take a zero-byte stream-ordered allocation? 8-bit Adam's empty fallback
    # moments (a shard of tiles only) and cudarc's empty slices ask for one.
    echo "== cuMemAllocAsync of 0 bytes"
    python3 - <<'PY' 2>&1 || echo "probe failed"
import ctypes
cu = ctypes.CDLL("libcuda.so.1")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
steps = [("cuInit", lambda: cu.cuInit(0)),
         ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), 0)),
         ("cuDevicePrimaryCtxRetain", lambda: cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
         ("cuCtxSetCurrent", lambda: cu.cuCtxSetCurrent(ctx)),
         ("cuMemAllocAsync(0 bytes)",
          lambda: cu.cuMemAllocAsync(ctypes.byref(ptr), ctypes.c_size_t(0), ctypes.c_void_p(0)))]
for name, call in steps:
    r = call()
    print(f"{name}: {r} (0 is CUDA_SUCCESS)")
    if r != 0:
        break
else:
    print(f"pointer {ptr.value:#x}; free: {cu.cuMemFreeAsync(ptr, ctypes.c_void_p(0))}, "
          f"sync: {cu.cuStreamSynchronize(ctypes.c_void_p(0))}")
PY
    for exe in "$bins"/*candle-cuda*; do
        [[ -x $exe ]] || continue
        echo "== ldd $(basename "$exe") (libraries not found)"
        ldd "$exe" 2>&1 | grep 'not found' || echo "none"
    done
} >"$res/machine.txt" 2>&1
cat "$res/machine.txt" >>"$log"

# --- Tests -----------------------------------------------------------------------------------
status=0
for exe in "$bins"/*-tests; do
    [[ -x $exe ]] || continue
    name=$(basename "$exe")
    say "== $name"
    # --test-threads=1: one context at a time keeps the output readable; --nocapture shows
    # each test's `skipped: <reason>` line, should the gate refuse the device.
    if limited 150 "$exe" --test-threads=1 --nocapture >"$res/$name.txt" 2>&1; then
        say "$name: ok"
    else
        say "$name: FAILED (exit $?)"
        status=1
    fi
    grep -E '^test |skipped:|test result' "$res/$name.txt" | tee -a "$log"
done
# --- Benchmarks on the GPU, each into bench-<what>.md and its section of a copy of -----------
# docs/benchmarks.md
cp docs/benchmarks.md "$res/benchmarks.md" 2>/dev/null || : >"$res/benchmarks.md"
gpu_bench() { # <binary> <what: optim | train> <section>
    say "== bench $2"
    if limited 150 "$bins/$1" bench "$2" --device cuda --out "$res/benchmarks.md" \
        >"$res/bench-$2.md" 2>"$res/bench-$2.log"; then
        say "bench $2: ok (table in bench-$2.md; section $3 of benchmarks.md updated)"
    else
        say "bench $2: FAILED (exit $?), see bench-$2.log"
        status=1
    fi
    tee -a "$log" <"$res/bench-$2.md"
}
[[ -x $bins/ragged ]] && gpu_bench ragged optim optim-cuda
if [[ -x $bins/ragged-candle-cuda ]]; then
    gpu_bench ragged-candle-cuda train train-cuda
    # The same step at world 1 with 1024 rows (the 64 rows above are a few milliseconds of
    # launches on an H200): the table only, into bench-train-1024.md.
    say "== bench train, world 1, 1024 rows"
    limited 90 "$bins/ragged-candle-cuda" bench train --device cuda --worlds 1 --batch 1024 \
        --out - >"$res/bench-train-1024.md" 2>"$res/bench-train-1024.log" ||
        say "bench train (1024 rows): FAILED (exit $?), see bench-train-1024.log"
    grep '^|' "$res/bench-train-1024.md" | tee -a "$log"
else
    say "bench train --device cuda: skipped: no ragged-candle-cuda binary (built without nvcc)"
fi
# --- Training: thread ranks with GPU collectives, and a one-process NCCL world -------------
if [[ -x $bins/train ]]; then
    say "== train"
    if limited 60 "$bins/train" --size tiny --steps 5 --ranks 2 --comm gpu-threads \
        >"$res/train-gpu-threads.txt" 2>&1; then
        say "train --comm gpu-threads: ok"
    else
        say "train --comm gpu-threads: FAILED (exit $?)"
        status=1
    fi
    # HSDP: 2 replicas of 2 GPU thread ranks (groups split on the device).
    if limited 60 "$bins/train" --size tiny --steps 5 --ranks 4 --replicas 2 --comm gpu-threads \
        >"$res/train-gpu-threads-hsdp.txt" 2>&1; then
        say "train --comm gpu-threads --replicas 2: ok"
    else
        say "train --comm gpu-threads --replicas 2: FAILED (exit $?)"
        status=1
    fi
    if RAGGED_RANK=0 RAGGED_WORLD_SIZE=1 RAGGED_NCCL_ID_FILE="$ids/nccl-id" \
        limited 60 "$bins/train" --size tiny --steps 5 --batch 4 --comm nccl \
        >"$res/train-nccl.txt" 2>&1; then
        say "train --comm nccl (world of 1): ok"
    else
        say "train --comm nccl (world of 1): FAILED (exit $?)"
        status=1
    fi
    # A world of 2 whose rank 1 never starts: rank 0 must give up joining NCCL's communicator
    # within RAGGED_NCCL_TIMEOUT_S and exit with an error (status 1), its abandoned join
    # thread notwithstanding; a hang is the timeout's 124.
    rc=0
    RAGGED_NCCL_TIMEOUT_S=3 RAGGED_RANK=0 RAGGED_WORLD_SIZE=2 RAGGED_NCCL_ID_FILE="$ids/nccl-id-alone" \
        limited 30 "$bins/train" --size tiny --steps 5 --batch 4 --comm nccl \
        >"$res/train-nccl-alone.txt" 2>&1 || rc=$?
    if [[ $rc -eq 1 ]] && grep -q "joined the NCCL communicator within" "$res/train-nccl-alone.txt"; then
        say "train --comm nccl (rank 1 of 2 missing): ok, a timeout error"
    else
        say "train --comm nccl (rank 1 of 2 missing): FAILED (exit $rc), see train-nccl-alone.txt"
        status=1
    fi
    # The model itself on the GPU (`--device cuda`) needs the candle-cuda build of the example
    # (scripts/build-gpu-bins.sh says whether it could make one); without it, a skip. Each run
    # is compared with its unsharded CPU reference and fails when a parameter differs by more
    # than 0.1 × steps × lr (`--check-drift`: a step moves a parameter by about lr at most, so
    # more than a tenth of that means the GPU run trained a different model; on the CPU the
    # same runs differ by 1.2e-7, against a bound of 1.5e-3).
    if [[ -x $bins/train-candle-cuda ]]; then
        for run in gpu-threads nccl hsdp; do
            comm=$run ranks=(--ranks 2)
            [[ $run == nccl ]] && ranks=(--batch 4)
            # HSDP on device buffers: 2 replicas of 2 GPU thread ranks.
            [[ $run == hsdp ]] && comm=gpu-threads ranks=(--ranks 4 --replicas 2)
            if RAGGED_RANK=0 RAGGED_WORLD_SIZE=1 RAGGED_NCCL_ID_FILE="$ids/nccl-id-device" \
                limited 90 "$bins/train-candle-cuda" --size tiny --steps 5 "${ranks[@]}" \
                --comm "$comm" --device cuda --check-drift 0.1 \
                >"$res/train-device-cuda-$run.txt" 2>&1; then
                say "train --device cuda --comm $comm ${ranks[*]}: ok"
            else
                say "train --device cuda --comm $comm ${ranks[*]}: FAILED (exit $?)"
                status=1
            fi
        done
        # Every other optimizer with the model on the GPU (AdamW, the default, ran above):
        # Muon's, 8-bit Adam's and Shampoo's device steps (Shampoo's roots on the host).
        for opt in muon adam8bit shampoo; do
            if limited 90 "$bins/train-candle-cuda" --size tiny --steps 5 --ranks 2 \
                --comm gpu-threads --device cuda --optimizer "$opt" --check-drift 0.1 \
                >"$res/train-device-cuda-$opt.txt" 2>&1; then
                say "train --device cuda --comm gpu-threads --optimizer $opt: ok"
            else
                say "train --device cuda --comm gpu-threads --optimizer $opt: FAILED (exit $?)"
                status=1
            fi
        done
        # Checkpoints of device state through the example: 4 steps saved after the second
        # (8-bit Adam, two GPU thread ranks), resumed from step 2 (folder step-00000002) at the same world size: the
        # final parameter digests must be equal (the same kernels in the same order); then
        # resumed on the CPU's thread ranks at world 3 (it must load and finish). cuBLAS is
        # asked for its deterministic workspace, as torch does for reproducible runs.
        ckpt=$work/ckpt
        common=(--size tiny --steps 4 --optimizer adam8bit --batch 6)
        export CUBLAS_WORKSPACE_CONFIG=:4096:8
        if limited 90 "$bins/train-candle-cuda" "${common[@]}" --ranks 2 --comm gpu-threads \
            --device cuda --checkpoint-dir "$ckpt" --save-every 2 >"$res/train-ckpt-save.txt" 2>&1 &&
            limited 90 "$bins/train-candle-cuda" "${common[@]}" --ranks 2 --comm gpu-threads \
                --device cuda --resume "$ckpt/step-00000002" >"$res/train-ckpt-resume.txt" 2>&1 &&
            limited 90 "$bins/train-candle-cuda" "${common[@]}" --ranks 3 \
                --resume "$ckpt/step-00000002" >"$res/train-ckpt-resume-cpu.txt" 2>&1; then
            digest() { grep -o 'parameter digest.*' "$1"; }
            if [[ -n $(digest "$res/train-ckpt-save.txt") &&
                $(digest "$res/train-ckpt-save.txt") == $(digest "$res/train-ckpt-resume.txt") ]]; then
                say "train --device cuda, saved and resumed: ok, the same digest"
            else
                say "train --device cuda, saved and resumed: FAILED, digests differ (a resume" \
                    "bug or GPU nondeterminism: compare the loss columns of train-ckpt-*.txt)"
                status=1
            fi
        else
            say "train --device cuda with checkpoints: FAILED (exit $?), see train-ckpt-*.txt"
            status=1
        fi
    else
        say "train --device cuda: skipped: no train-candle-cuda binary (built without nvcc)"
    fi
    grep -H "max |parameter difference|" "$res"/train-*.txt | sed "s|^$res/||" | tee -a "$log"
fi
if grep -q 'skipped:' "$res"/*-tests.txt 2>/dev/null; then
    say "note: some tests were skipped (no usable device or library): see the lines above"
    # On a machine that is meant to have a GPU, a skip is a failure of the check.
    [[ ${RAGGED_EXPECT_GPU:-0} == 1 ]] && status=3
fi
say "results in $dest: gpu-check.log, machine.txt, benchmarks.md, gpu-results.tgz ($SECONDS s)"
exit $status
