"""Diagnostic (GPU): what the backward gains by letting the first vocabulary chunk's GEMM store dE
instead of zero-filling the fp32 (N, H) accumulator and adding to it (session 9, ``de_gemm``).

    python3 scripts/diag_de_first_chunk.py [--n 16384] [--h 4096] [--vocab 16032 128256]

1. The GEMM alone (dz (N, 4096) @ c_chunk (4096, H), bf16 in, fp32 out): store, zero + add, add.
2. The per-token step (forward + backward of ``linear_cross_entropy``, reduction="none"),
   current code against the old zero + add, alternating three times in this one process.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton.testing

from vocab_parallel_loss import linear_cross_entropy
from vocab_parallel_loss.kernels import linear_cross_entropy as K


def bench(fn, rep=1000):
    return triton.testing.do_bench(fn, warmup=50, rep=rep)


def old_de_gemm(de, dz, c_chunk, cfg, first):
    if first:
        de.zero_()
    K.gemm_acc(de, dz, c_chunk, cfg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[16032, 128256])
    ap.add_argument("--rep", type=int, default=1000)
    args = ap.parse_args()
    n, h, dev = args.n, args.h, "cuda"
    cfg = K.default_config(torch.device(dev))
    g = torch.Generator(device=dev).manual_seed(0)
    dz = torch.randn(n, 4096, device=dev, generator=g).bfloat16()
    cc = torch.randn(4096, h, device=dev, generator=g).bfloat16()
    acc = torch.empty(n, h, device=dev)
    gemm = dict(
        store_ms=bench(lambda: K.de_gemm(acc, dz, cc, cfg, True), args.rep),
        zero_add_ms=bench(lambda: old_de_gemm(acc, dz, cc, cfg, True), args.rep),
        add_ms=bench(lambda: K.de_gemm(acc, dz, cc, cfg, False), args.rep),
    )
    gemm["tflops"] = {k: round(2 * n * 4096 * h / v / 1e9, 1) for k, v in gemm.items()}
    print("gemm", json.dumps(gemm), flush=True)
    new = K.de_gemm
    for v in args.vocab:
        e = (torch.randn(n, h, device=dev, generator=g) * 0.5).bfloat16().requires_grad_()
        c = (torch.randn(v, h, device=dev, generator=g) * 0.02).bfloat16().requires_grad_()
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        up = torch.rand(n, device=dev, generator=g) + 0.5

        def step():
            loss = linear_cross_entropy(e, c, t, reduction="none", impl="triton")
            torch.autograd.grad(loss, (e, c), up)

        times = {"store": [], "zero_add": []}
        grads = {}
        for _ in range(3):
            for name, fn in (("store", new), ("zero_add", old_de_gemm)):
                K.de_gemm = fn
                times[name].append(bench(step, args.rep))
                loss = linear_cross_entropy(e, c, t, reduction="none", impl="triton")
                grads[name] = torch.autograd.grad(loss, (e, c), up)
        K.de_gemm = new
        same = all(torch.equal(a, b) for a, b in zip(grads["store"], grads["zero_add"]))
        row = dict(n=n, h=h, v=v, ms={k: [round(x, 3) for x in xs] for k, xs in times.items()},
                   median_ms={k: round(statistics.median(xs), 3) for k, xs in times.items()},
                   grads_bitwise_equal=same)
        print("step", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
