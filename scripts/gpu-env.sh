# Sourced by scripts/gpu-check.sh and by kernel experiments on a GPU machine: unpacks the
# binaries that scripts/build-gpu-bins.sh left in $bins (xz) into $unpacked and points $bins
# there, and puts the CUDA libraries of pip wheels (or the system's) on LD_LIBRARY_PATH, with
# a libnccl.so link in $links. Needs: bins, unpacked, links (folders) and a `say` function.
# build-gpu-bins.sh leaves the binaries xz-compressed (what travels to this machine is limited
# to 64 MiB, and the candle-cuda ones hold candle's kernels as PTX text): unpack them with
# Python's lzma, which every python3 has.
if compgen -G "$bins/*.xz" >/dev/null; then
    python3 - "$bins" "$unpacked" <<'PY' || { say "could not unpack $bins"; return 2; }
import lzma, os, shutil, sys
src, dst = sys.argv[1:3]
for name in sorted(os.listdir(src)):
    if name.endswith(".xz"):
        out = os.path.join(dst, name[: -len(".xz")])
        with lzma.open(os.path.join(src, name)) as packed, open(out, "wb") as plain:
            shutil.copyfileobj(packed, plain)
        os.chmod(out, 0o755)
PY
    bins=$unpacked
fi
libdirs=()
sitedirs=$(python3 - <<'PY' 2>/dev/null
import site, sys
paths = set(site.getsitepackages() + [site.getusersitepackages()] + sys.path)
print("\n".join(p for p in paths if p))
PY
)
for sp in $sitedirs /usr/local/lib/python3*/dist-packages /usr/lib/python3/dist-packages; do
    [[ -d $sp/nvidia ]] || continue
    while IFS= read -r lib; do
        d=$(dirname "$lib")
        [[ " ${libdirs[*]-} " == *" $d "* ]] || libdirs+=("$d")
    done < <(find "$sp/nvidia" -name 'libcublas.so*' -o -name 'libnvrtc.so*' -o -name 'libnccl.so*' \
        -o -name 'libcublasLt.so*' -o -name 'libnvrtc-builtins.so*' -o -name 'libcurand.so*' \
        -o -name 'libcudart.so*' 2>/dev/null)
done
for d in "${libdirs[@]-}"; do
    [[ -n $d ]] || continue
    # cudarc finds libcublas.so.13 and libnvrtc.so.13 by their sonames; NCCL's is
    # libnccl.so.2, which it does not try.
    [[ -e $d/libnccl.so.2 ]] && ln -sf "$d/libnccl.so.2" "$links/libnccl.so"
done
if ! ls "$links"/libnccl.so >/dev/null 2>&1; then
    sys_nccl=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
    [[ -n ${sys_nccl:-} ]] && ln -sf "$sys_nccl" "$links/libnccl.so"
fi
joined=$(IFS=:; echo "${libdirs[*]-}")
export LD_LIBRARY_PATH="$links${joined:+:$joined}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
ls -l "$links" >>"$log" 2>&1

