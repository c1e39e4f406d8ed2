"""Diagnostic (GPU): does host time leak into bench.py's GPU timings of short steps?

bench.py times each rep with CUDA events around the forward and the backward, with no sync
between reps, so the host normally runs ahead of the GPU and its launch overhead is hidden. A
reduced loss at 16384 x 16032 is short on the GPU (~0.28 ms forward, an exit-only backward) and
long on the host (three launches, autograd, ~90-250 us on a slow host): the hypothesis is that the
"slow mode" of that case (docs/NOTES.md) is the GPU draining its queue and waiting for the host.

    python3 scripts/diag_host_bound.py [--case 16384x16032] [--reps 300]

Runs bench.py's rep loop (L2 flush, stamp, forward, stamp, backward, stamp) for ours, mean path:
  plain           as bench.py
  slow host       plus a busy wait of --delay-us on the host per rep (a slower host)
  slow host, GPU lead   the same, and a GPU sleep of --lead-us queued before each flush, so the
                  GPU has work queued ahead while the host catches up
If the slow host's times grow and the lead brings them back, host time leaks into the timings.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vocab_parallel_loss import cross_entropy


def busy_wait(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def sleep_cycles(us: float) -> int:
    """GPU clock cycles for about ``us`` microseconds at the H200's 1980 MHz SM clock (longer
    at a lower clock, which only deepens the queue)."""
    return int(us * 1980)


def run(x, t, flush, reps, delay_us, lead_us):
    stamps = []
    cyc = sleep_cycles(lead_us) if lead_us else 0
    for _ in range(reps):
        if cyc:
            torch.cuda._sleep(cyc)
        flush.zero_()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        c = torch.cuda.Event(enable_timing=True)
        a.record()
        loss = cross_entropy(x, t, reduction="mean")
        b.record()
        loss.backward()
        c.record()
        stamps.append((a, b, c))
        x.grad = None
        if delay_us:
            busy_wait(delay_us)
    torch.cuda.synchronize()
    fwd = statistics.median(a.elapsed_time(b) for a, b, _ in stamps)
    bwd = statistics.median(b.elapsed_time(c) for _, b, c in stamps)
    return round(fwd * 1e3, 1), round(bwd * 1e3, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="16384x16032")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--delay-us", type=float, default=300.0)
    ap.add_argument("--lead-us", type=float, default=1000.0)
    args = ap.parse_args()
    n, v = (int(s) for s in args.case.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, v, device="cuda", generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    run(x, t, flush, 20, 0, 0)  # warm-up and compile
    modes = {"plain": (0, 0), "slow host": (args.delay_us, 0),
             "slow host, GPU lead": (args.delay_us, args.lead_us), "plain, GPU lead": (0, args.lead_us)}
    out = {}
    for rnd in range(2):  # twice, alternating, to see the spread
        for name, (d, lead) in modes.items():
            out.setdefault(name, []).append(run(x, t, flush, args.reps, d, lead))
    print(json.dumps(dict(case=args.case, reps=args.reps, delay_us=args.delay_us,
                          lead_us=args.lead_us, fwd_bwd_us=out), indent=1))


if __name__ == "__main__":
    main()
