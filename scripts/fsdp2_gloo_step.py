#!/usr/bin/env python3
"""PyTorch FSDP2 (`fully_shard`) + gloo on CPU processes, on the model of `ragged bench train`,
next to ragged's own step measured in the same run.

    /tmp/ragged-venv/bin/python scripts/fsdp2_gloo_step.py --worlds 2,4
    (torch from PyPI: python3 -m venv /tmp/ragged-venv && /tmp/ragged-venv/bin/pip install torch)

Model: `layers` blocks of Linear(width→hidden), GELU, Linear(hidden→width), no bias; global batch
`batch` rows split over the ranks; MSE loss against random targets; SGD. One FSDP2 unit per block
plus the root (as ragged's unit per block), reshard_after_forward=True (FSDP2's default; ragged's
default `reshard, keep graph` variant is the same rhythm: parameters freed after forward, graph and
activations kept, re-gathered for backward), f32. Mean of `steps` steps after one warm-up, rank 0.
Memory per rank: each torch process's peak RSS during the timed steps (sampled every 2 ms by a
thread) above its RSS just before the model is built (torch imported, process group up), the
largest over the ranks; ragged's is the bench's counting-allocator heap peak above the bytes
alive before (the initial full values excluded), per rank (heap, not RSS: torch's figure also
holds allocator slack and pages glibc kept). Then runs `target/release/ragged bench train` with the same sizes and
prints both. Prints `skipped` and exits 0 when torch is missing.
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
    rss_before = rss_bytes()
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
    sampler = RssSampler()
    for step in range(args.steps + 1):
        if step == 1:
            sampler.start()
        dist.barrier()
        t = time.perf_counter()
        loss = nn.functional.mse_loss(blocks(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if step > 0:
            times.append(time.perf_counter() - t)
    peak = sampler.stop() - rss_before
    out.put((rank, sum(times) / len(times), peak))
    dist.destroy_process_group()


class RssSampler:
    """The peak RSS of this process while running, sampled every 2 ms on a thread."""

    def __init__(self):
        import threading
        self.peak = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def start(self):
        self.thread.start()

    def run(self):
        while not self.done.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def stop(self):
        self.done.set()
        self.thread.join()
        return max(self.peak, rss_bytes())


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def fsdp2_step(world, args):
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + world + (os.getpid() % 1000)
    procs = [ctx.Process(target=rank_main, args=(r, world, args, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    seconds = next(t for r, t, _ in results if r == 0)
    return seconds, max(m for _, _, m in results)


def ragged_steps(args):
    exe = os.path.join(os.path.dirname(__file__), "..", "target", "release", "ragged")
    cmd = [exe, "bench", "train", "--worlds", args.worlds, "--steps", str(args.steps),
           "--layers", str(args.layers), "--width", str(args.width), "--hidden", str(args.hidden),
           "--batch", str(args.batch), "--out", "-"]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # variant, V, step s, ..., measured MiB/rank, loss (bench train's table)
        if len(cells) > 3 and re.fullmatch(r"\d+", cells[1]):
            rows[(cells[0], int(cells[1]))] = (float(cells[2]), cells[-2])
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
    nan = (float("nan"), "-")
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus; step seconds, mean of {args.steps} after a warm-up")
    print("| V | torch FSDP2 + gloo s | ragged (reshard, keep graph) s | ragged / FSDP2 | ragged (recompute) s "
          "| ragged FSDP2-style layout s | torch MiB/rank (peak RSS in steps) | ragged MiB/rank (heap, keep graph) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in worlds:
        t, mem = torch_s[w]
        k = ragged.get(("ragged, reshard, keep graph", w), nan)
        r = ragged.get(("ragged, recompute", w), nan)
        f = ragged.get(("fsdp2-style, reshard, keep graph", w), nan)
        print(f"| {w} | {t:.3f} | {k[0]:.3f} | {k[0] / t:.2f} | {r[0]:.3f} | {f[0]:.3f} "
              f"| {mem / 2**20:.1f} | {k[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
