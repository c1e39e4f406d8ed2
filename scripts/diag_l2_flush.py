"""How much of a kernel's time is the write-back of the L2 flush before it (H200 diagnostic).

    python scripts/diag_l2_flush.py --shapes 16384x16032,65536x16032,16384x32000

The benchmarks evict the logits from L2 before each timed rep by zeroing 256 MiB, as
``triton.testing.do_bench`` does. That leaves up to the whole L2 dirty, and the timed kernel then
pays for writing it back to HBM. This times our forward (2 B/element read) and backward (2 B read
+ 2 B written) kernels after the plain flush ("dirty") and after the same flush followed by an
untimed read-only sweep of another 256 MiB ("clean": the dirty lines are written back before the
kernel starts, and L2 holds only clean lines the kernel does not need). The difference is the
flush's write-back, a cost of the measurement setup, not of the kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from vocab_parallel_loss._layout import like_rows, row_view
from vocab_parallel_loss._options import LossOptions
from vocab_parallel_loss.kernels import cross_entropy as K

from bench import Device  # scripts/ is on the path when run as a script
from tune_kernels import copy_bandwidth


def timed(fn, dev, reps: int) -> float:
    """Median ms of ``fn`` over ``reps``, each after ``dev``'s L2 flush."""
    events = []
    for _ in range(reps):
        torch.cuda._sleep(200_000)  # keeps the GPU ahead of the host: no launch gap is timed
        dev.flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x16032,65536x16032,16384x32000")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    devices = {mode: Device("cuda", mode) for mode in ("dirty", "clean")}  # bench.py's flushes
    rows = []
    for spec in args.shapes.split(","):
        n, v = (int(d) for d in spec.split("x"))
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 3
        t = torch.randint(0, v, (n,), device="cuda")
        loss, lse = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        g = torch.randn(n, device="cuda")
        view = row_view(x)
        dview = like_rows(view)
        opts = LossOptions(0, v, -100, 0.0, 0.0)
        phases = {
            "fwd": (lambda: K.forward(view, t, opts, None, loss, lse), 2),
            "bwd": (lambda: K.backward(view, dview, t, lse, g, None, opts), 4),
        }
        for phase, (fn, bytes_per) in phases.items():
            fn()
            bound_ms = bytes_per * n * v / bw * 1e3
            for mode, dev in devices.items():
                ms = timed(fn, dev, args.reps)
                rows.append(dict(n=n, v=v, phase=phase, mode=mode, ms=ms, ratio=ms / bound_ms))
                print(f"{n}x{v} {phase} {mode}: {ms * 1e3:.1f} us, {ms / bound_ms:.3f}x the bound",
                      flush=True)
        x = dview = None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bandwidth=bw, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
