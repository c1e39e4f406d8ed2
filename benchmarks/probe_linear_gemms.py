"""The gradient GEMMs of the fused linear loss alone, on the GPU: the dC GEMM of a row chunk
stored in bf16, stored in fp32 and added into an fp32 accumulator (cuBLAS, and the Triton GEMM),
the dE GEMM of the chunk and cuBLAS's bare logits GEMM, for chunks of several row counts. What
the gradients formed in forward cost per chunk, and which chunk sizes cuBLAS runs well.

    python benchmarks/probe_linear_gemms.py --vocab 128256 16032 --rows 4096 5504 8192
"""

from __future__ import annotations

import argparse

import torch

from vocab_parallel_loss.kernels.linear import gemm
from vocab_parallel_loss.kernels.linear.config import default_config


def _ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the host queues the reps while the GPU sleeps
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256, 16032])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 5504, 8192])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    cfg = default_config(torch.device("cuda"))
    h = args.hidden
    for v in args.vocab:
        for rows in args.rows:
            dz = torch.randn(rows, v, device="cuda").bfloat16()
            e = torch.randn(rows, h, device="cuda").bfloat16()
            c = torch.randn(v, h, device="cuda").bfloat16()
            acc = torch.zeros(v, h, device="cuda")
            out16 = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
            de = torch.empty(rows, h, device="cuda")
            cases = {
                "dC store bf16": (lambda: gemm.gemm_store(out16, dz.t(), e, cfg), args.reps),
                "dC store fp32": (lambda: gemm.gemm_store(acc, dz.t(), e, cfg), args.reps),
                "dC add fp32": (lambda: gemm.gemm_acc(acc, dz.t(), e, cfg), args.reps),
                "dC add fp32, Triton": (lambda: gemm._mm(dz.t(), e, acc, True, cfg), 5),
                "dE store fp32": (lambda: gemm.gemm_store(de, dz, c, cfg), args.reps),
                "logits bf16, cuBLAS": (lambda: torch.mm(e, c.t()), args.reps),
            }
            for name, (fn, reps) in cases.items():
                ms = _ms(fn, reps)
                print(f"V={v} rows={rows} {name:22s} {ms:8.3f} ms "
                      f"{2 * rows * v * h / ms / 1e9:7.1f} TFLOP/s", flush=True)
            del dz, e, c, acc, out16, de
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
