"""Where the time of one fused-linear training step goes, on the GPU: the kernels of a step
(torch.profiler) with their total time, the step back to back with and without the host ahead of
the GPU, and the host time of forward and of backward.

    python benchmarks/profile_linear.py --vocab 16032 --reduction mean
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from vocab_parallel_loss import linear_cross_entropy


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384, help="tokens")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=16032)
    ap.add_argument("--reduction", default="mean", choices=["mean", "sum", "none"])
    ap.add_argument("--memory-budget-gib", type=float, default=None)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    e = (torch.randn(args.n, args.hidden, device="cuda", generator=g) * 0.5).bfloat16()
    c = (torch.randn(args.vocab, args.hidden, device="cuda", generator=g) * 0.02).bfloat16()
    e.requires_grad_()
    c.requires_grad_()
    t = torch.randint(0, args.vocab, (args.n,), device="cuda", generator=g)
    up = torch.rand(args.n, device="cuda", generator=g) + 0.5
    budget = None if args.memory_budget_gib is None else args.memory_budget_gib * 2**30

    def forward():
        return linear_cross_entropy(e, c, t, reduction=args.reduction, memory_budget=budget)

    def step():
        loss = forward()
        return torch.autograd.grad(loss, (e, c), up if args.reduction == "none" else None)

    for _ in range(10):
        step()
    torch.cuda.synchronize()

    def gpu_ms_per_step(host_ahead: bool) -> float:
        torch.cuda.synchronize()
        if host_ahead:  # a queued sleep lets the host issue the steps before the GPU runs them
            torch.cuda._sleep(200_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.steps):
            step()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / args.steps

    print(f"back to back: {gpu_ms_per_step(False):.3f} ms/step; with the host ahead: "
          f"{gpu_ms_per_step(True):.3f} ms/step")

    def host_ms(fn) -> float:
        times = []
        for _ in range(11):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return 1e3 * sorted(times)[5]

    fwd = host_ms(forward)

    def backward():
        loss = forward()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.autograd.grad(loss, (e, c), up if args.reduction == "none" else None)
        return time.perf_counter() - t0

    bwd = 1e3 * sorted(backward() for _ in range(11))[5]
    print(f"host time (median): forward {fwd:.3f} ms, backward {bwd:.3f} ms")

    from torch.profiler import ProfilerActivity, profile

    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name[:90]]
            k[0] += 1
            k[1] += getattr(ev, "device_time_total", 0.0)
    total = sum(k[1] for k in kernels.values())
    count = sum(k[0] for k in kernels.values())
    print(f"kernels per step: {count / reps:.0f}, kernel time per step: {total / reps / 1e3:.3f} ms")
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"{us / reps / 1e3:8.3f} ms  x{n / reps:4.1f}  {name}")


if __name__ == "__main__":
    main()
