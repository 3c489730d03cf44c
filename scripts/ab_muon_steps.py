#!/usr/bin/env python3
"""Two builds of ragged's `muon_steps` example, stepped alternately: an A/B timing of a change
in which both builds see the same machine load (a step of each, `--reps` times).

    cp target/release/examples/muon_steps /tmp/muon_steps_before   # before the change
    cargo build --release -p ragged-optimizers --example muon_steps  # after it
    python3 scripts/ab_muon_steps.py /tmp/muon_steps_before target/release/examples/muon_steps \
        [--kind muon|muon-bf16] [--reps 5]

Prints each round and the median and range of the per-round ratios after / before, and both
best times. `RAYON_NUM_THREADS=1` in the environment times one core.
"""
import argparse
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--kind", default="muon", choices=["muon", "muon-bf16"])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    procs = [subprocess.Popen([b, args.kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for b in (args.before, args.after)]
    for name, p in zip(("before", "after"), procs):
        ready = p.stdout.readline().strip()
        if not ready.startswith("ready"):
            sys.exit(f"{name}: the build did not start its steps ({ready!r})")
        print(f"{name}: {ready}", flush=True)
    times = ([], [])
    for r in range(args.reps):
        for p, ts in zip(procs, times):
            p.stdin.write("step\n")
            p.stdin.flush()
            ts.append(float(p.stdout.readline()))
        print(f"round {r + 1}: before {times[0][-1]:.3f} s, after {times[1][-1]:.3f} s, "
              f"after/before {times[1][-1] / times[0][-1]:.3f}", flush=True)
    for p in procs:
        p.stdin.write("quit\n")
        p.stdin.flush()
        p.wait()
    ratios = sorted(b / a for a, b in zip(*times))
    print(f"after/before per round: median {ratios[len(ratios) // 2]:.3f}, range "
          f"{ratios[0]:.3f}-{ratios[-1]:.3f} over {len(ratios)} rounds; best before "
          f"{min(times[0]):.3f} s, after {min(times[1]):.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
