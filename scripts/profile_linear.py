"""Where the time of the fused linear cross entropy goes, next to plain cuBLAS (one GPU).

    python scripts/profile_linear.py [--n 16384 --h 4096 --vocab 128256 16032] [--out FILE.json]

Prints (and writes as JSON) median milliseconds and TFLOP/s of:
- cuBLAS GEMMs of the shapes our kernels issue: full logits (bf16 and fp32 output), row chunks
  and column chunks of fp32 logits, the dE and dC GEMMs of a column chunk and of a row chunk;
- our pieces: forward statistics (fused Triton vs chunked cuBLAS + row kernel) and backward
  (fused recompute vs chunked), for the same inputs.
The ratio of our pieces to the cuBLAS lines is what limits the end-to-end figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vocab_parallel_loss.kernels import linear_cross_entropy as K  # noqa: E402

F32 = torch.float32


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def report(rows, name, ms, flops):
    r = dict(name=name, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1))
    rows.append(r)
    print(json.dumps(r), flush=True)


def gemms(rows, n, h, v):
    e = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    c = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
    full = 2 * n * h * v
    report(rows, f"V={v} mm E@C.T bf16 out (N,V)", bench(lambda: e @ c.t()), full)
    out = torch.empty(n, v, device="cuda", dtype=F32) if n * v * 4 < 12 << 30 else None
    if out is not None:
        report(rows, f"V={v} mm E@C.T fp32 out (N,V)",
               bench(lambda: torch.mm(e, c.t(), out_dtype=F32, out=out)), full)
        del out
    for rows_c in (256, 1024, 4096):
        x = torch.empty(rows_c, v, device="cuda", dtype=F32)

        def row_chunks():
            for r0 in range(0, n, rows_c):
                r1 = min(n, r0 + rows_c)
                torch.mm(e[r0:r1], c.t(), out_dtype=F32, out=x[:r1 - r0])
        report(rows, f"V={v} logits row chunks of {rows_c} fp32", bench(row_chunks), full)
        # the gif GEMMs of one row chunk, scaled to all rows
        dz = torch.randn(rows_c, v, device="cuda", dtype=torch.bfloat16)
        de = torch.empty(rows_c, h, device="cuda", dtype=F32)
        dc = torch.zeros(v, h, device="cuda", dtype=F32)
        k = triton.cdiv(n, rows_c)
        report(rows, f"V={v} gif dE chunk {rows_c} (x{k})",
               bench(lambda: torch.mm(dz, c, out_dtype=F32, out=de)) * k, full)
        report(rows, f"V={v} gif dC acc chunk {rows_c} (x{k})",
               bench(lambda: torch.addmm(dc, dz.t(), e[:rows_c], out_dtype=F32, out=dc)) * k,
               full)
    for cols in (1024, 2048, 4096):
        x = torch.empty(n, cols, device="cuda", dtype=F32)
        k = triton.cdiv(v, cols)
        report(rows, f"V={v} logits col chunk {cols} fp32 (x{k})",
               bench(lambda: torch.mm(e, c[:cols].t(), out_dtype=F32, out=x)) * k, full)
        dz = torch.randn(n, cols, device="cuda", dtype=torch.bfloat16)
        de = torch.zeros(n, h, device="cuda", dtype=F32)
        report(rows, f"V={v} dE += dz@C col chunk {cols} (x{k})",
               bench(lambda: torch.addmm(de, dz, c[:cols], out_dtype=F32, out=de)) * k, full)
        dcs = torch.empty(cols, h, device="cuda", dtype=F32)
        report(rows, f"V={v} dC = dz.T@E col chunk {cols} fp32 out (x{k})",
               bench(lambda: torch.mm(dz.t(), e, out_dtype=F32, out=dcs)) * k, full)
        report(rows, f"V={v} dC = dz.T@E col chunk {cols} bf16 out (x{k})",
               bench(lambda: torch.mm(dz.t(), e)) * k, full)
    torch.cuda.empty_cache()


def pieces(rows, n, h, v):
    g = torch.Generator(device="cuda").manual_seed(0)
    e = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16()
    c = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    base = K.default_config(e.device)
    full = 2 * n * h * v
    ref = None
    for mode in ("fused", "chunked"):
        cfg = base.replace(fwd_mode=mode, bwd_mode=mode)
        ms = bench(lambda: K.forward_stats(e, c, None, t, 0, None, False, cfg))
        report(rows, f"V={v} ours forward_stats {mode}", ms, full)
        stats = K.forward_stats(e, c, None, t, 0, None, False, cfg)
        lse = stats[0] + torch.log(stats[1])
        if ref is None:
            ref = lse
        else:
            print(f"  lse max diff fused vs chunked: {(lse - ref).abs().max().item():.3g}")
        g1 = torch.full_like(lse, 1.0 / n)
        coef = torch.stack([lse, g1, g1, torch.zeros_like(g1)])
        ms = bench(lambda: K.backward(e, c, None, t, 0, coef, None, True, True, False, cfg))
        report(rows, f"V={v} ours backward {mode} (recompute + dE + dC)", ms, 3 * full)
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256, 16032])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for v in args.vocab:
        gemms(rows, args.n, args.h, v)
        pieces(rows, args.n, args.h, v)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(
            device=torch.cuda.get_device_name(), torch=torch.__version__,
            triton=triton.__version__, n=args.n, h=args.h, rows=rows), indent=1))


if __name__ == "__main__":
    main()
