"""Time the fused reduced-loss kernel (forward + unit gradient) against the two-pass path.

    python scripts/sweep_fused_reduced.py
"""

from __future__ import annotations

import torch
import triton
import triton.testing

from vocab_parallel_loss._layout import like_rows, row_view
from vocab_parallel_loss.kernels import cross_entropy as K


def main() -> None:
    a = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    bw = 2 * a.numel() / (triton.testing.do_bench(lambda: b.copy_(a)) * 1e-3)
    del a, b
    for n, v in [(16384, 16032), (65536, 16032), (16384, 32000)]:
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, v, (n,), device="cuda")
        view, dview = row_view(x), like_rows(row_view(x))
        loss, lse = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        count = (t != -100).sum()
        block = triton.next_power_of_2(v)
        bound_ms = 4 * n * v / bw * 1e3
        for warps in (4, 8, 16, 32):
            fn = lambda: K._ce_fused_reduced_kernel[(n,)](  # noqa: E731
                x, dview.tensor, t, loss, lse, count, v, view.D1, view.s0, view.s1, dview.s0,
                dview.s1, 1, -100, 0.0, 0.0, MEAN=True, HAS_SMOOTHING=False, HAS_Z=False,
                BLOCK=block, num_warps=warps)
            try:
                ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                print(f"fused {n}x{v} warps={warps}: {ms:.3f} ms = {ms / bound_ms:.2f}x 4B", flush=True)
            except Exception as e:
                print(f"fused {n}x{v} warps={warps}: {type(e).__name__}", flush=True)
        opts = dict(vocab_start=0, vocab_size=v, ignore_index=-100, smoothing=0.0, z_loss=0.0)

        def two_pass():
            K.forward(view, t, loss=loss, lse=lse, **opts)
            K.backward(view, dview, t, lse, torch.ones((), device="cuda"), count, **opts)

        ms = triton.testing.do_bench(two_pass, warmup=10, rep=50)
        print(f"two-pass {n}x{v}: {ms:.3f} ms = {ms / bound_ms:.2f}x 4B", flush=True)
        del x, dview


if __name__ == "__main__":
    main()
