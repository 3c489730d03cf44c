#!/usr/bin/env python3
"""PyTorch FSDP2 (`fully_shard`) + gloo on CPU processes, on the model of `ragged bench train`,
next to ragged's own step measured in the same run.

    /tmp/ragged-venv/bin/python scripts/fsdp2_gloo_step.py --worlds 2,4
    (torch from PyPI: python3 -m venv /tmp/ragged-venv && /tmp/ragged-venv/bin/pip install torch)

Model: `layers` blocks of Linear(width→hidden), GELU, Linear(hidden→width), no bias; global batch
`batch` rows split over the ranks; MSE loss against random targets; SGD. One FSDP2 unit per block
plus the root (as ragged's unit per block), reshard_after_forward=True (FSDP2's default, ragged's
`recompute` variant keeps the same memory rhythm without activation checkpointing in torch:
torch keeps activations, ragged recomputes), f32. Mean of `steps` steps after one warm-up, rank 0.
Then runs `target/release/ragged bench train` with the same sizes and prints both. Prints
`skipped` and exits 0 when torch is missing.
"""
import argparse
import os
import re
import subprocess
import sys
import time


def rank_main(rank, world, args, port, out):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    blocks = nn.Sequential(*[
        nn.Sequential(nn.Linear(args.width, args.hidden, bias=False), nn.GELU(),
                      nn.Linear(args.hidden, args.width, bias=False))
        for _ in range(args.layers)
    ])
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(blocks, mesh=mesh)
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-3)
    rows = args.batch // world
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(rows, args.width, generator=g)
    y = torch.randn(rows, args.width, generator=g)
    times = []
    for step in range(args.steps + 1):
        dist.barrier()
        t = time.perf_counter()
        loss = nn.functional.mse_loss(blocks(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - t)
    if rank == 0:
        out.put(sum(times) / len(times))
    dist.destroy_process_group()


def fsdp2_step(world, args):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + world + (os.getpid() % 1000)
    procs = [ctx.Process(target=rank_main, args=(r, world, args, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    seconds = out.get(timeout=1800)
    for p in procs:
        p.join()
    return seconds


def ragged_steps(args):
    exe = os.path.join(os.path.dirname(__file__), "..", "target", "release", "ragged")
    cmd = [exe, "bench", "train", "--worlds", args.worlds, "--steps", str(args.steps),
           "--layers", str(args.layers), "--width", str(args.width), "--hidden", str(args.hidden),
           "--batch", str(args.batch), "--out", "-"]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| (ragged, recompute|plain candle|fsdp2-style, recompute) \| (\d+) \| ([\d.]+) \|", line)
        if m:
            rows[(m.group(1), int(m.group(2)))] = float(m.group(3))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skipped: torch is not installed")
        return 0
    worlds = [int(w) for w in args.worlds.split(",")]
    torch_s = {w: fsdp2_step(w, args) for w in worlds}
    ragged = ragged_steps(args)
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus; step seconds, mean of {args.steps} after a warm-up")
    print("| V | torch FSDP2 + gloo | ragged (recompute) | ragged / FSDP2 | ragged FSDP2-style layout |")
    print("|---:|---:|---:|---:|---:|")
    for w in worlds:
        r = ragged.get(("ragged, recompute", w), float("nan"))
        f = ragged.get(("fsdp2-style, recompute", w), float("nan"))
        print(f"| {w} | {torch_s[w]:.3f} | {r:.3f} | {r / torch_s[w]:.2f} | {f:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
