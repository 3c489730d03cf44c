#!/usr/bin/env python3
"""Static instruction count of the 8-bit Adam kernel's hot path, without a GPU.

    source scripts/candle-cuda-env.sh            # nvcc 13.0 from PyPI wheels
    python3 scripts/adam8bit_sass_count.py [kernels/adam8bit.cu ...]

Compiles each kernel file for sm_90 with the flags NVRTC gets at run time (no FMA
contraction, IEEE division and square root, no flush to zero), disassembles it (`nvdisasm`
from the nvidia-cuda-nvdisasm wheel, fetched into $TMPDIR/ragged-nvdisasm when not on PATH)
and counts the instructions one lane executes for one whole, aligned scale block on the
common path: lerp's small-weight form (the source is compiled with `fabsf(w) < 0.5f` made
`true`, so the compiler keeps one copy), the fast paths of the IEEE square root and division
(their slow-path calls and the moves that set them up are left out), and the quantization
with both scales' reciprocals and no NaN (the general quantize_scaled branch is left out);
where the compiler made two copies of a loop for two values of a uniform condition, one. The
count runs from the basic block of the vector path's first load to its code stores, so it
leaves out the per-block search for the scale block and the grid loop; divide by 8 for a
per-element figure. It is a proxy for time on a GPU where the kernel is bound by instruction issue
(docs/benchmarks.md, optim-cuda), not a measurement of it.
"""
import collections
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

FLAGS = ["-arch=sm_90", "-Xptxas", "-v", "-fmad=false", "-prec-div=true",
         "-prec-sqrt=true", "-ftz=false"]
INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s")


def nvdisasm():
    """The nvdisasm binary: on PATH, or unpacked from its PyPI wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    home = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / "ragged-nvdisasm"
    binary = home / "x/nvidia/cu13/bin/nvdisasm"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d",
                        str(home / "whl"), "nvidia-cuda-nvdisasm==13.2.51"], check=True)
        for wheel in (home / "whl").glob("*.whl"):
            subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(home / "x")],
                           check=True)
        binary.chmod(0o755)
    return str(binary)


def compile_kernel(source, work):
    """(registers, SASS lines) of `source` with lerp's small-weight form fixed."""
    text = pathlib.Path(source).read_text()
    if "fabsf(w) < 0.5f" not in text:
        sys.exit(f"{source}: no `fabsf(w) < 0.5f` to fix lerp's form by")
    fixed = work / "kernel.cu"
    fixed.write_text(text.replace("fabsf(w) < 0.5f", "true"))
    cubin = work / "kernel.cubin"
    out = subprocess.run(["nvcc", "--cubin", *FLAGS, "-o", str(cubin), str(fixed)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr)
    registers = re.search(r"Used (\d+) registers", out.stderr).group(1)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr).group(1)
    sass = subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    return f"{registers} registers, {spills} bytes spilled", sass


def hot_path(sass):
    """The vector path's lines, less the cold branches (see the module doc)."""
    # From the basic block of the first 8-byte code load (only the vector path loads codes
    # as uint2) to its code stores.
    load = next(i for i, l in enumerate(sass) if "LDG.E.64" in l)
    start = max(i for i in range(load) if sass[i].startswith(".L_x"))
    end = next(i for i, l in enumerate(sass) if i > load and "STG.E.64" in l) + 2
    seg = sass[start:end]
    cold = set()
    for i, line in enumerate(seg):
        general = re.search(r"BRA P\d, `\((\.L_x_\d+)\)", line)
        if general:  # both scales' reciprocals are finite: jump over quantize_scaled
            label = general.group(1) + ":"
            cold.update(range(i + 1, next(k for k in range(i, len(seg))
                                          if seg[k].strip() == label)))
        if "CALL.REL" in line:  # a slow path: the call and its argument moves
            k = i
            while k > 0 and "BRA" not in seg[k - 1]:
                k -= 1
            cold.update(range(k, i + 1))
            after = seg[i + 1] if i + 1 < len(seg) else ""
            if ("BRA" in after and "@" not in after) or "IMAD.MOV" in after:
                cold.add(i + 1)
    # An if/else whose two arms are both long and whose first calls nothing: the common case
    # written first and its general form (the quantization with both reciprocals and no NaN,
    # then quantize_scaled, whose divisions may call their slow path), or the compiler's
    # copies of one loop for two values of a uniform condition (the session-23 kernel's
    # quantizer for signed and unsigned maps); the else arm is left out.
    for i, line in enumerate(seg):
        jump = re.search(r"^\s+/\*\w+\*/\s+BRA `\((\.L_x_\d+)\)", line)
        if not jump or i + 1 >= len(seg) or not seg[i + 1].startswith(".L_x"):
            continue
        else_label, join_label = seg[i + 1].strip()[:-1], jump.group(1) + ":"
        branch = next((k for k in range(i) if f"`({else_label})" in seg[k]), None)
        join = next((k for k in range(i, len(seg)) if seg[k].strip() == join_label), None)
        if branch is None or join is None:
            continue
        arms = (range(branch + 1, i), range(i + 1, join))
        calls = lambda a: any("CALL" in seg[k] for k in a)
        if all(len(a) > 50 for a in arms) and not calls(arms[0]):
            cold.update(arms[1])
    return [l for i, l in enumerate(seg) if INSTRUCTION.match(l) and i not in cold]


def opcode(line):
    text = re.sub(r"^@!?U?P\w+\s+", "", line.split("*/", 1)[1].strip())
    return text.split()[0].split(".")[0]


def main():
    sources = sys.argv[1:] or ["kernels/adam8bit.cu"]
    for source in sources:
        with tempfile.TemporaryDirectory() as work:
            usage, sass = compile_kernel(source, pathlib.Path(work))
        hot = hot_path(sass)
        counts = collections.Counter(opcode(l) for l in hot)
        print(f"{source}: {len(hot)} instructions a lane for one scale block "
              f"({len(hot) / 8:.1f} an element); {usage}")
        print("  " + " ".join(f"{k} {v}" for k, v in counts.most_common()))


if __name__ == "__main__":
    main()
