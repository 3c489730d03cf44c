#!/usr/bin/env python3
"""`torch.optim.Muon` on the 28 matrices of `ragged bench optim`'s Llama-style row, for the
Muon-step comparison (target: ragged's step <= 0.5x torch's on the same machine).

The matrices are those of `ragged_optimizers::bench::llama_stack(1024, 4)`: 4 layers of
q/o 1024x1024, k/v 256x1024, gate/up 3584x1024, down 1024x3584 (f32 parameters; torch's Muon
runs its Newton-Schulz in bf16). Also prints same-run f32 and bf16 matmul rates of torch.

Run (from the repository root):
    python3 -m venv /tmp/ragged-venv && /tmp/ragged-venv/bin/pip install torch   # PyPI
    /tmp/ragged-venv/bin/python scripts/muon_vs_torch.py [--threads N] [--reps 5]
and compare with the `llama d=1024 x4 (28 matrices)` rows of
    cargo run --release --bin ragged -- bench optim --only muon --no-write
Without torch (or a torch without torch.optim.Muon) it prints why and exits 0 (skipped).

On a shared machine the load moves between runs, so the ratio of two separate runs is noisy.
`--interleave muon,muon-bf16` starts ragged's `muon_steps` example (one Muon step on the same
28 matrices per request; build it first with
    cargo build --release -p ragged-optimizers --example muon_steps
) once per listed variant and alternates: one torch step, then one step of each ragged
variant, `--reps` times, so every ratio compares steps taken seconds apart. It prints each
round and the median (and range) of the per-round ratios ragged / torch.
"""
import argparse
import os
import subprocess
import sys
import time


def shapes(d=1024, layers=4):
    kv, inter = d // 4, d * 7 // 2
    per_layer = [(d, d), (kv, d), (kv, d), (d, d), (inter, d), (inter, d), (d, inter)]
    return per_layer * layers


def matmul_gflops(torch, dtype, n=2048, reps=3):
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--interleave", default="",
                    help="comma-separated ragged variants (muon, muon-bf16) to step between torch's")
    ap.add_argument("--steps-bin", default="target/release/examples/muon_steps")
    args = ap.parse_args()
    try:
        import torch
    except Exception as e:
        print(f"skipped: torch is needed ({e})")
        return 0
    if not hasattr(torch.optim, "Muon"):
        print(f"skipped: torch {torch.__version__} has no torch.optim.Muon (2.9 or newer)")
        return 0
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(r, c) * 0.02) for r, c in shapes()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Muon(params, lr=0.02)
    opt.step()  # untimed: state allocation
    variants = [v for v in args.interleave.split(",") if v]
    ragged = {}
    for v in variants:
        proc = subprocess.Popen([args.steps_bin, v], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        print(proc.stdout.readline().strip(), flush=True)  # "ready ..." after its first step
        ragged[v] = (proc, [])
    times = []
    for r in range(args.reps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        line = f"round {r + 1}: torch {times[-1]:.2f} s"
        for v, (proc, ts) in ragged.items():
            proc.stdin.write("step\n")
            proc.stdin.flush()
            ts.append(float(proc.stdout.readline()))
            line += f", ragged {v} {ts[-1]:.2f} s ({ts[-1] / times[-1]:.2f}x)"
        print(line, flush=True)
    for v, (proc, ts) in ragged.items():
        proc.stdin.write("quit\n")
        proc.stdin.flush()
        proc.wait()
        ratios = sorted(a / b for a, b in zip(ts, times))
        print(f"ragged {v} / torch.optim.Muon, per round: median {ratios[len(ratios) // 2]:.2f}, "
              f"range {ratios[0]:.2f}-{ratios[-1]:.2f} over {len(ratios)} rounds")
    times.sort()
    n = sum(p.numel() for p in params)
    print(f"torch {torch.__version__}, {args.threads} threads, {len(params)} matrices, {n} params")
    print(f"same-run matmul 2048^3: f32 {matmul_gflops(torch, torch.float32):.1f} GFLOP/s, "
          f"bf16 {matmul_gflops(torch, torch.bfloat16):.1f} GFLOP/s")
    print(f"torch.optim.Muon step: best {1e3 * times[0]:.1f} ms, "
          f"median {1e3 * times[len(times) // 2]:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
