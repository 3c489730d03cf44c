#!/usr/bin/env python3
"""`torch.optim.Muon` on the 28 matrices of `ragged bench optim`'s Llama-style row, for the
Muon-step comparison (target: ragged's step <= 0.5x torch's on the same machine).

The matrices are those of `ragged_optimizers::bench::llama_stack(1024, 4)`: 4 layers of
q/o 1024x1024, k/v 256x1024, gate/up 3584x1024, down 1024x3584 (f32 parameters; torch's Muon
runs its Newton-Schulz in bf16). Also prints same-run f32 and bf16 matmul rates of torch.
ragged's default (`NsMethod::Auto`) runs Gram Newton-Schulz on the wide and tall matrices
(the same polynomial, iterated on X.X^T with restarts; numerics in the README); the
environment variable RAGGED_NS_METHOD=standard, which the `muon_steps` processes inherit,
times torch's own iteration instead.

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


def ns_flops(rows, cols, steps=5):
    """Nominal FLOPs of Newton-Schulz on one matrix (ragged's `bench::ns_flops`)."""
    s, l = min(rows, cols), max(rows, cols)
    return steps * (4 * s * s * l + 2 * s ** 3 + 3 * s * s + 3 * s * l) + 3 * s * l


def newton_schulz_f32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's iteration with every product in f32 (the `--torch-ns float32` patch):
    short side first, Frobenius-normalize, then X <- a*X + (b*A + c*A@A)@X with A = X@X^T."""
    import torch

    a, b, c = ns_coefficients
    x = grad.to(dtype=torch.float32, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


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
    ap.add_argument("--torch-ns", choices=["bfloat16", "float32"], default="bfloat16",
                    help="torch Muon's Newton-Schulz dtype (float32: patched in, see above)")
    ap.add_argument("--force-bf16", action="store_true",
                    help="time stock torch.optim.Muon even where its bf16 matmul is a slow fallback")
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
    rates = {dt: matmul_gflops(torch, dt, n=1024, reps=1) for dt in (torch.float32, torch.bfloat16)}
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"matmul 1024^3: f32 {rates[torch.float32]:.1f} GFLOP/s, "
          f"bf16 {rates[torch.bfloat16]:.1f} GFLOP/s", flush=True)
    if args.torch_ns == "float32":
        import torch.optim._muon as muon_mod
        muon_mod._zeropower_via_newtonschulz = newton_schulz_f32
        print("torch Muon's Newton-Schulz patched to f32 (newton_schulz_f32)", flush=True)
    elif rates[torch.bfloat16] < rates[torch.float32] / 10 and not args.force_bf16:
        flops = sum(ns_flops(r, c) for r, c in shapes())
        est = flops / (rates[torch.bfloat16] * 1e9)
        print(f"skipped: torch's bf16 matmul runs at {rates[torch.bfloat16]:.2f} GFLOP/s here "
              f"(a fallback path, under f32's / 10), so a stock torch.optim.Muon step on these "
              f"{len(shapes())} matrices would take about {est:.0f} s ({flops / 1e9:.0f} nominal "
              f"GFLOP); use --torch-ns float32 for torch's Muon with f32 products, or --force-bf16")
        return 0
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
    # bf16 at 2048^3 only where it is not the slow fallback (there it takes minutes).
    bf16_2048 = (f"{matmul_gflops(torch, torch.bfloat16):.1f} GFLOP/s"
                 if rates[torch.bfloat16] >= rates[torch.float32] / 10 else "not timed (fallback)")
    print(f"same-run matmul 2048^3: f32 {matmul_gflops(torch, torch.float32):.1f} GFLOP/s, "
          f"bf16 {bf16_2048}")
    print(f"torch.optim.Muon step: best {1e3 * times[0]:.1f} ms, "
          f"median {1e3 * times[len(times) // 2]:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
