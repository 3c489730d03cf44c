#!/usr/bin/env python3
"""The parameter digest ragged prints (`ShardedModel::param_digest`) of a safetensors file.

    python3 scripts/param_digest.py model.safetensors [--skip NAME ...]

Per tensor: SHA-256 over the name's UTF-8 bytes, each dimension as a little-endian u64 and
the values as little-endian f32 (bf16 and f16 widened exactly); then SHA-256 over those
32-byte digests in name order. Only the standard library: the safetensors header is JSON
after an 8-byte little-endian length. Tensors of other dtypes (integer ids, masks) are left
out, as `load_safetensors` leaves them out of the model; `--skip` leaves out more (for a
file with tensors the model does not have).
"""

import argparse
import hashlib
import json
import struct
import sys

WIDTHS = {"F32": 4, "BF16": 2, "F16": 2}


def as_f32_bytes(dtype, raw):
    """The values as little-endian f32 bytes."""
    if dtype == "F32":
        return raw
    n = len(raw) // 2
    halves = struct.unpack(f"<{n}H", raw)
    if dtype == "BF16":  # the top half of an f32: exact
        return struct.pack(f"<{n}I", *(h << 16 for h in halves))
    # F16: struct's 'e' reads IEEE half, Python floats hold it exactly, 'f' writes it exactly.
    return struct.pack(f"<{n}f", *struct.unpack(f"<{n}e", raw))


def digest(path, skip):
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    per_tensor = []
    for name, info in header.items():
        if name == "__metadata__" or name in skip or info["dtype"] not in WIDTHS:
            continue
        start, end = info["data_offsets"]
        h = hashlib.sha256(name.encode())
        for d in info["shape"]:
            h.update(struct.pack("<Q", d))
        h.update(as_f32_bytes(info["dtype"], data[start:end]))
        per_tensor.append((name, h.digest()))
    per_tensor.sort()
    total = hashlib.sha256()
    for _, d in per_tensor:
        total.update(d)
    return total.hexdigest(), len(per_tensor)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--skip", nargs="*", default=[], help="tensor names to leave out")
    args = p.parse_args()
    try:
        value, n = digest(args.file, set(args.skip))
    except (OSError, ValueError, KeyError, struct.error) as e:
        sys.exit(f"error: {args.file}: not a readable safetensors file ({e})")
    print(f"{value}  ({n} tensors)")


if __name__ == "__main__":
    main()
