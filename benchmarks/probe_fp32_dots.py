"""Probe: the cost and error of fp32-class products on tensor cores for an fp32 LM head.

One Triton GEMM ``z = a @ b.T`` (``a`` hidden (M, K), ``b`` weight rows (N, K)) in each way of
forming fp32-class products, against fp64, with PyTorch's fp32 matmul (TF32 off / on) beside
it. Modes: ``bf16`` (both operands rounded to bf16, the scale), ``tf32``, ``tf32x3``,
``bf16x3``, ``bf16x6`` (Triton's own split products), ``h3`` (both operands scaled per row by a
power of two and split in the kernel into two fp16 parts, three products: what the package runs
for two fp32 operands, ``common.dot``), ``h2`` (hidden in bf16, one fp16 part, the fp32 weight in
two: the package's fp32 head with bf16 hidden states), ``ieee`` (CUDA cores), ``w3_pre`` /
``x6_pre`` (the split made before the GEMM into bf16 parts: weight only / both operands, six
products), ``w_tf32x3`` (bf16 hidden widened, tf32x3). The split modes sum each K step's
products into a fresh accumulator, then add it.

    python benchmarks/probe_fp32_dots.py --m 8192 --k 4096 --n 16384
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from vocab_parallel_loss.kernels.linear.common import dot as package_dot, load_scales, unscale
from vocab_parallel_loss.kernels.linear.scales import split_scales


@triton.jit
def _gemm(A, B, Z, A2, A3, B2, B3, SA, SB, M, N, K, MODE: tl.constexpr, DOT: tl.constexpr,
          PREC: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    npm = tl.cdiv(M, BM)
    npn = tl.cdiv(N, BN)
    width = GROUP * npn
    first = (pid // width) * GROUP
    gs = tl.minimum(npm - first, GROUP)
    pm = first + (pid % width) % gs
    pn = (pid % width) // gs
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = A + rm.to(tl.int64)[:, None] * K + rk[None, :]
    b_ptrs = B + rn.to(tl.int64)[None, :] * K + rk[:, None]
    a2_ptrs = A2 + rm.to(tl.int64)[:, None] * K + rk[None, :]
    a3_ptrs = A3 + rm.to(tl.int64)[:, None] * K + rk[None, :]
    b2_ptrs = B2 + rn.to(tl.int64)[None, :] * K + rk[:, None]
    b3_ptrs = B3 + rn.to(tl.int64)[None, :] * K + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    sa, ra = load_scales(SA, rm, DOT)
    sb, rb = load_scales(SB, rn, DOT)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if MODE == 1:  # hidden bf16, weight fp32 in two fp16 parts (the package's "h2")
            acc = package_dot(a, b, acc, DOT, False, sa, sb)
        elif MODE == 2:  # hidden bf16 widened to fp32 (exact in tf32), weight tf32x3
            acc = tl.dot(a.to(tl.float32), b, acc, input_precision="tf32x3")
        elif MODE == 3:  # weight pre-split in three bf16 tensors (B, B2, B3)
            step = tl.dot(a, tl.load(b3_ptrs))
            step = tl.dot(a, tl.load(b2_ptrs), step)
            acc += tl.dot(a, b, step)
            b2_ptrs += BK
            b3_ptrs += BK
        elif MODE == 4:  # both pre-split in three bf16 parts: the six products of bf16x6
            a2 = tl.load(a2_ptrs)
            a3 = tl.load(a3_ptrs)
            b2 = tl.load(b2_ptrs)
            b3 = tl.load(b3_ptrs)
            step = tl.dot(a3, b)
            step = tl.dot(a, b3, step)
            step = tl.dot(a2, b2, step)
            step = tl.dot(a2, b, step)
            step = tl.dot(a, b2, step)
            acc += tl.dot(a, b, step)
            a2_ptrs += BK
            a3_ptrs += BK
            b2_ptrs += BK
            b3_ptrs += BK
        elif MODE == 5:  # both in two fp16 parts: three products (the package's "h3")
            acc = package_dot(a, b, acc, DOT, False, sa, sb)
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BK
        b_ptrs += BK
    acc = unscale(acc, ra, rb, DOT)
    tl.store(Z + rm.to(tl.int64)[:, None] * N + rn[None, :], acc)


def run_mode(mode, a32, b32, cfg):
    M, K = a32.shape
    N = b32.shape[0]
    z = torch.empty(M, N, device=a32.device, dtype=torch.float32)
    kind, prec = 0, "tf32"
    a2 = a3 = b2 = b3 = None
    if mode == "bf16":
        a, b = a32.bfloat16(), b32.bfloat16()
    elif mode == "h2":
        a, b, kind = a32.bfloat16(), b32, 1
    elif mode == "w_tf32x3":
        a, b, kind = a32.bfloat16(), b32, 2
    elif mode == "w3_pre":
        a, kind = a32.bfloat16(), 3
        b, b2, b3 = split3(b32)
    elif mode == "h3":
        a, b, kind = a32, b32, 5
    elif mode == "x6_pre":
        kind = 4
        a, a2, a3 = split3(a32)
        b, b2, b3 = split3(b32)
    else:
        a, b, prec = a32, b32, mode
    BM, BN, BK, warps, stages = cfg
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
    a2 = a if a2 is None else a2
    a3 = a if a3 is None else a3
    b2 = b if b2 is None else b2
    b3 = b if b3 is None else b3
    sa, sb = split_scales(a, 1), split_scales(b, 1)  # (per row of each; the modes that scale)
    dot = {5: "h3", 1: "h2"}.get(kind, "tf32")
    fn = lambda: _gemm[grid](a, b, z, a2, a3, b2, b3, sa, sb, M, N, K, MODE=kind, DOT=dot,
                             PREC=prec, BM=BM, BN=BN, BK=BK, GROUP=8, num_warps=warps,
                             num_stages=stages)
    return fn, z


def split3(x):
    hi = x.bfloat16()
    r = x - hi.float()
    mid = r.bfloat16()
    return hi, mid, (r - mid.float()).bfloat16()


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[len(ts) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--m", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--modes", default="bf16,tf32,tf32x3,bf16x3,bf16x6,h3,h2,w_tf32x3,w3_pre,x6_pre,ieee")
    p.add_argument("--hidden-bf16", action="store_true",
                   help="hidden states hold bf16 values (an fp32 head's cast)")
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(args.m, args.k, device="cuda", generator=g)
    if args.hidden_bf16:
        a = a.bfloat16().float()
    b = torch.randn(args.n, args.k, device="cuda", generator=g) * 0.02
    rows = slice(0, 512)
    hi, mid, lo = split3(b)
    torch.cuda.synchronize()
    ms = timed(lambda: split3(b))
    print(f"splitting the (N, K) fp32 weight into three bf16 parts: {ms:.3f} ms")
    ref = (a[rows].double() @ b.double().T)
    flops = 2 * args.m * args.n * args.k
    out = []
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        fn = lambda: a @ b.T
        ms = timed(fn)
        err = (fn()[rows].double() - ref).abs().max().item()
        out.append(dict(mode=f"torch fp32 tf32={'on' if tf32 else 'off'}", ms=ms,
                        tflops=flops / ms / 1e9, max_err=err))
    torch.backends.cuda.matmul.allow_tf32 = False
    cfgs = {"bf16": [(128, 256, 64, 8, 3), (128, 128, 64, 4, 4)],
            "h2": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 32, 8, 3),
                   (128, 128, 32, 8, 4), (64, 256, 32, 4, 3)],
            "fp32": [(128, 128, 32, 8, 3), (128, 128, 32, 8, 4), (128, 128, 64, 8, 2),
                     (128, 128, 64, 8, 3), (64, 128, 32, 4, 4)]}
    for mode in args.modes.split(","):
        group = ("bf16" if mode in ("bf16", "w3_pre", "x6_pre") else
                 "h2" if mode in ("h2", "w_tf32x3") else "fp32")
        best = None
        for cfg in cfgs[group]:
            try:
                fn, z = run_mode(mode, a, b, cfg)
                ms = timed(fn, reps=3 if mode == "ieee" else 10)
            except Exception as exc:  # unsupported precision or out of resources
                print(f"{mode} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            err = (z[rows].double() - ref).abs().max().item()
            row = dict(mode=mode, cfg=cfg, ms=ms, tflops=flops / ms / 1e9, max_err=err)
            print(json.dumps(row))
            if best is None or ms < best["ms"]:
                best = row
        if best:
            out.append(best)
    print("| mode | ms | TFLOP/s | max abs error vs fp64 |")
    print("|---|---|---|---|")
    for r in out:
        print(f"| {r['mode']} {r.get('cfg', '')} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['max_err']:.2e} |")


if __name__ == "__main__":
    main()
