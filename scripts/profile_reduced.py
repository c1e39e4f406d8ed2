"""GPU time of each kernel of a reduced loss's forward + backward (CUDA, torch.profiler).

    python scripts/profile_reduced.py [--shapes 16384x32000,65536x16032] [--upstream 1.0]

Shows where the time of the ``"mean"`` path goes besides the main kernel (the count of kept
tokens, the reduction, the backward that acts only for an upstream gradient other than 1), for
the fused path and, with ``VPL_FUSED_REDUCED=0``, the two passes.
"""

from __future__ import annotations

import argparse
import collections
import importlib

import torch
from torch.profiler import ProfilerActivity, profile

from vocab_parallel_loss import cross_entropy

ce = importlib.import_module("vocab_parallel_loss.cross_entropy")  # the package exports a function


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x32000,16384x16032,65536x16032,16384x32000-fp32")
    ap.add_argument("--upstream", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    for spec in args.shapes.split(","):
        dims, _, dt = spec.partition("-")
        n, v = (int(d) for d in dims.split("x"))
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        x = (torch.randn(n, v, device="cuda") * 3).to(dtype).requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda")
        g = torch.tensor(args.upstream, device="cuda")
        for fused in (True, False):
            ce._plans.clear()
            ce.os.environ[ce.FUSED_ENV] = "1" if fused else "0"
            for _ in range(3):
                torch.autograd.grad(cross_entropy(x, t, reduction="mean"), x, g)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    torch.autograd.grad(cross_entropy(x, t, reduction="mean"), x, g)
                torch.cuda.synchronize()
            total = collections.Counter()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    total[e.name[:60]] += e.device_time_total if hasattr(e, "device_time_total") \
                        else e.cuda_time_total
            print(f"{spec} {'fused' if fused else 'two passes'} (upstream {args.upstream}), "
                  f"us per call:")
            for name, us in total.most_common():
                print(f"  {us / args.reps:9.1f}  {name}")
        ce.os.environ.pop(ce.FUSED_ENV)


if __name__ == "__main__":
    main()
