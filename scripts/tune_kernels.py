"""Sweep launch parameters of the cross-entropy kernels on a GPU (kernel time only).

    python scripts/tune_kernels.py --out tune.json

For each shape and each (BLOCK, num_warps) the forward (statistics + loss) and backward (gradient)
kernels are timed with triton.testing.do_bench; the ratio is the time over the memory-traffic
bound (forward reads 2 B/element, backward reads 2 and writes 2) at the copy bandwidth measured in
the same run. The best configurations go into kernels/cross_entropy.py's *_config functions.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton.testing

from vocab_parallel_loss._layout import like_rows, row_view
from vocab_parallel_loss._options import LossOptions
from vocab_parallel_loss.kernels import cross_entropy as K

SHAPES = [(16384, 32000), (16384, 128256), (8192, 256000), (16384, 16032), (65536, 16032)]


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=5, rep=50)
    return 2 * a.numel() / (ms * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--shapes", default=None, help="e.g. 16384x16032,65536x16032")
    ap.add_argument("--stages", default=None, help="also sweep num_stages, e.g. 1,2,3,4")
    ap.add_argument("--fwd-blocks", default="1024,2048,4096")
    ap.add_argument("--fwd-warps", default="2,4,8")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--fwd-split", default="0", help="SPLIT values of the forward, e.g. 0,1")
    args = ap.parse_args()
    plain_fwd, plain_bwd = K.forward_config, K.backward_config
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    results = []
    shapes = SHAPES[:1] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    stages = [int(x) for x in args.stages.split(",")] if args.stages else [None]
    for n, v in shapes:
        x = torch.randn(n, v, device="cuda", dtype=torch.bfloat16) * 3
        t = torch.randint(0, v, (n,), device="cuda")
        loss = torch.empty(n, device="cuda")
        lse = torch.empty(n, device="cuda")
        g = torch.randn(n, device="cuda")
        view = row_view(x)
        dview = like_rows(view)
        opts = LossOptions(0, v, -100, 0.0, 0.0)
        elems = n * v
        def with_stages(cfgs):
            return [dict(c, num_stages=st) if st else c for c in cfgs for st in stages]

        fwd_cfgs = with_stages([dict(BLOCK=b, VEC=vec, num_warps=w, SPLIT=bool(sp))
                                for b, vec, w, sp in itertools.product(
                                    [int(b) for b in args.fwd_blocks.split(",")], [8],
                                    [int(w) for w in args.fwd_warps.split(",")],
                                    [int(sp) for sp in args.fwd_split.split(",")])])
        bwd_cfgs = with_stages([dict(BLOCK=b, num_warps=w) for b, w in
                                itertools.product([8192, 16384], [4, 8, 16, 32])])
        phases = [("fwd", fwd_cfgs, 2)] + ([] if args.fwd_only else [("bwd", bwd_cfgs, 4)])
        for phase, cfgs, bytes_per in phases:
            best = None
            for cfg in cfgs:
                # the swept parameters over the defaults (the eviction hints stay as shipped)
                if phase == "fwd":
                    K.forward_config = lambda *_a, c=dict(plain_fwd(v, x.dtype), **cfg): c
                    fn = lambda: K.forward(view, t, opts, None, loss, lse)  # noqa: E731
                else:
                    K.backward_config = lambda *_a, c=dict(plain_bwd(v, x.dtype), **cfg): c
                    fn = lambda: K.backward(view, dview, t, lse, g, None, opts)  # noqa: E731
                try:
                    fn()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=60)
                except Exception as e:  # a config the compiler rejects
                    print(f"{phase} {n}x{v} {cfg} failed: {type(e).__name__}")
                    continue
                ratio = ms * 1e-3 / (bytes_per * elems / bw)
                row = dict(phase=phase, n=n, v=v, **cfg, ms=ms, ratio=ratio)
                results.append(row)
                if best is None or ms < best["ms"]:
                    best = row
            print(f"best {phase} {n}x{v}: {best}", flush=True)
        x = dview = None  # free this shape before the next one allocates
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bandwidth=bw, results=results), f, indent=1)


if __name__ == "__main__":
    main()
