"""Does a process group slow the loss's host path? (bench run 14: 26.5 us per forward before
the collective created a 1-rank NCCL group, 46.7 us after; session 11 saw both orders.)

    python scripts/diag_host_group.py [--rounds 5]

In one process, the host time per forward on a tiny input (``host_overhead.per_call_us``) is
measured ``--rounds`` times before a group exists, then after one (with a collective run), then
with the process pinned to the core it runs on, then after 3000 more collectives (as many as
bench.py's ``measure_collective`` runs between its two host measurements), then 2 s later, then
after the group is destroyed and 2 s after that; before the group, also 2 s after the first
measurement, and 2 s later again after half a second of busy spinning (does idling alone, the
CPU's power management, slow the next calls?). Each line gives the core the process last ran
on and its thread count, so a move to another core or the group's threads show up beside the
figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from host_overhead import per_call_us
from vocab_parallel_loss import cross_entropy


def last_cpu() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])  # field 39: the CPU last run on


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def rounds(label: str, fn, n: int) -> list:
    out = []
    for i in range(n):
        us = per_call_us(fn)
        out.append(us)
        print(f"{label:14s} round {i}: {us:6.1f} us per forward  cpu {last_cpu():3d}  "
              f"threads {threads()}", flush=True)
    print(f"{label:14s} median {statistics.median(out):.1f} us, best {min(out):.1f}", flush=True)
    return out


def spin(seconds: float) -> None:
    """Keep the core busy (a training loop's host never idles for seconds): if idling is what
    slows the loss's host path, a spin first should undo it."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 128, (8,), device="cuda")

    def fwd():
        return cross_entropy(x, t)

    rounds("no group", fwd, args.rounds)
    time.sleep(2.0)  # idle without a group: does idling alone slow the next calls?
    rounds("idle, no group", fwd, args.rounds)
    time.sleep(2.0)
    spin(0.5)
    rounds("idle, spun", fwd, args.rounds)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    buf = torch.zeros(4, 16384, device="cuda")
    out = torch.empty(1, 4, 16384, device="cuda")
    dist.all_gather_into_tensor(out, buf)
    torch.cuda.synchronize()
    rounds("group", fwd, args.rounds)
    os.sched_setaffinity(0, {last_cpu()})
    rounds("pinned", fwd, args.rounds)
    for _ in range(3000):
        dist.all_gather_into_tensor(out, buf)
    torch.cuda.synchronize()
    rounds("3000 ops", fwd, args.rounds)
    time.sleep(2.0)  # if threads woken by the collectives spin for a while, they stop by now
    rounds("2 s idle", fwd, args.rounds)
    dist.destroy_process_group()
    rounds("after", fwd, args.rounds)
    time.sleep(2.0)
    rounds("after, idle", fwd, args.rounds)


if __name__ == "__main__":
    main()
