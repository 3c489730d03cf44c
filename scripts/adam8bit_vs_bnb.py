#!/usr/bin/env python3
"""8-bit Adam quality: ragged's drift from fp32 Adam next to bitsandbytes' on the same stream.

The streams (four matrices, 50 steps, seeded; gradients i.i.d., row-scaled, or row- and
column-scaled; see optimizers/src/drift.rs) are written by the Rust side, and this script
feeds the very same bits to bitsandbytes' `Adam8bit` and to `torch.optim.Adam` (fp32), then
prints ||p8 - p32|| / ||p32 - p0|| for both implementations, per stream.

Run (from the repository root):
    python3 -m venv /tmp/ragged-venv
    /tmp/ragged-venv/bin/pip install torch bitsandbytes    # PyPI; runs on the CPU
    /tmp/ragged-venv/bin/python scripts/adam8bit_vs_bnb.py

It builds and runs `cargo run --release -p ragged-optimizers --example adam8bit_drift DIR`
unless `--streams DIR` names a directory that already holds <structure>/stream.bin and
stream.json.
Without torch or bitsandbytes it prints why and exits 0 (skipped).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def load_stream(directory):
    import numpy as np

    with open(os.path.join(directory, "stream.json")) as f:
        meta = json.load(f)
    data = np.fromfile(os.path.join(directory, "stream.bin"), dtype="<f4")
    sizes = [r * c for r, c in meta["shapes"]]
    want = sum(sizes) * (1 + meta["steps"])
    if data.size != want:
        sys.exit(f"stream.bin holds {data.size} floats, stream.json announces {want}")
    at, out = 0, []
    for _ in range(1 + meta["steps"]):
        mats = []
        for (r, c), n in zip(meta["shapes"], sizes):
            mats.append(data[at:at + n].reshape(r, c))
            at += n
        out.append(mats)
    return meta, out[0], out[1:]


def run(torch, make_opt, p0, grads):
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in p0]
    opt = make_opt(params)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
    return [p.detach().double() for p in params]


def drift(torch, p, ref, p0):
    num = sum(float(((a - b) ** 2).sum()) for a, b in zip(p, ref))
    den = sum(float(((b - torch.from_numpy(c).double()) ** 2).sum()) for b, c in zip(ref, p0))
    return (num / den) ** 0.5


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", help="directory of <structure>/stream.* (default: generate)")
    args = ap.parse_args()
    try:
        import numpy  # noqa: F401
        import torch
        import bitsandbytes as bnb
    except Exception as e:  # ImportError, or a torch build that cannot load
        print(f"skipped: torch, numpy and bitsandbytes are needed ({e})")
        return 0
    directory = args.streams
    if directory is None:
        directory = tempfile.mkdtemp(prefix="ragged-drift-")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = ["cargo", "run", "--quiet", "--release", "-p", "ragged-optimizers",
               "--example", "adam8bit_drift", "--", directory]
        subprocess.run(cmd, cwd=root, check=True)
    print(f"torch {torch.__version__}, bitsandbytes {bnb.__version__}")
    print(f"{'stream':<10} {'bnb Adam8bit':>12} {'ragged Adam8bit':>15} {'ragged/bnb':>10}")
    for name in sorted(os.listdir(directory)):
        sub = os.path.join(directory, name)
        if not os.path.exists(os.path.join(sub, "stream.json")):
            continue
        meta, p0, grads = load_stream(sub)
        hp = dict(lr=meta["lr"], betas=tuple(meta["betas"]), eps=meta["eps"],
                  weight_decay=meta["weight_decay"])
        p32 = run(torch, lambda ps: torch.optim.Adam(ps, foreach=False, **hp), p0, grads)
        p8 = run(torch, lambda ps: bnb.optim.Adam8bit(ps, min_8bit_size=4096, **hp), p0, grads)
        b = drift(torch, p8, p32, p0)
        r = meta.get("ragged_drift")
        rs = f"{r:>15.5f} {r / b:>10.3f}" if r is not None else f"{'-':>15} {'-':>10}"
        print(f"{meta['structure']:<10} {b:>12.5f} {rs}")
    shapes = "+".join(f"{r}x{c}" for r, c in meta["shapes"])
    print(f"(each stream: {shapes}, {meta['steps']} steps, lr {meta['lr']}; "
          "drift = ||p8 - p32|| / ||p32 - p0|| against each library's own fp32 Adam)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
