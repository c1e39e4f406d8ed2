"""CPU-only: host cost of the Python layers around the kernel launches (kernels stubbed out).

    python scripts/wrapper_overhead.py [--profile]   (PROFILE_ROW="cross_entropy(none)" picks a row)
"""
from __future__ import annotations

import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # the Triton backend is chosen for CPU tensors

import torch  # noqa: E402

from vocab_parallel_loss import cross_entropy  # noqa: E402
from vocab_parallel_loss.kernels import cross_entropy as K  # noqa: E402


class _NoLaunch:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, n=20000) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main() -> None:
    for name in [n for n in dir(K) if n.startswith("_ce_") and n.endswith("_kernel")]:
        setattr(K, name, _NoLaunch())  # every launched kernel, the fused path's included
    x = torch.randn(8, 128, requires_grad=True)
    xd = x.detach()
    t = torch.randint(0, 128, (8,))
    x2 = torch.randn(4, 2, 128).transpose(0, 1).requires_grad_()  # Megatron's [s, b, v] view
    t2 = torch.randint(0, 128, (2, 4))
    rows = {
        "torch.empty(8) x2": lambda: (torch.empty(8), torch.empty(8)),
        "cross_entropy(none), no grad": lambda: cross_entropy(xd, t),
        "cross_entropy(none)": lambda: cross_entropy(x, t),
        "cross_entropy(none), [s, b] target": lambda: cross_entropy(x2, t2),
        "cross_entropy(mean)": lambda: cross_entropy(x, t, reduction="mean"),
        "fwd+bwd (none)": lambda: torch.autograd.grad(cross_entropy(x, t).sum(), x),
        "fwd+bwd (mean)": lambda: torch.autograd.grad(cross_entropy(x, t, reduction="mean"), x),
    }
    if "--profile" in sys.argv:
        import cProfile
        import pstats

        fn = rows[os.environ.get("PROFILE_ROW", "cross_entropy(mean)")]
        with cProfile.Profile() as prof:
            for _ in range(20000):
                fn()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    for name, fn in rows.items():
        print(f"{name:32s} {per_call_us(fn):8.2f} us", flush=True)


if __name__ == "__main__":
    main()
