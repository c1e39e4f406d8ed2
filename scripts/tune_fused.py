"""Sweep the fused forward+gradient kernel of reduced losses on a GPU (kernel time only).

    python scripts/tune_fused.py --out tune_fused.json

``kernels.cross_entropy.forward_grad`` reads each row twice, counting on the second read to hit
L2: the grid (``programs_per_sm``, 0 = one program per row), the warps and the block sizes set
how many rows are in flight and so whether they still are in L2. The ratio is kernel time over
the 4 B/element bound (2 read + 2 written; x2 for fp32) at the copy bandwidth of the same run;
``two_pass`` is the forward + backward kernels of the default path on the same shape.
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

from tune_kernels import copy_bandwidth  # scripts/ is on the path when run as a script

SHAPES = ["16384x32000", "16384x16032", "65536x16032", "16384x32000-fp32", "16384x65536",
          "16384x128256"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--warps", default="8,16,32")
    ap.add_argument("--per-sm", default="1,2,4,8,0")
    ap.add_argument("--smoothing", type=float, default=0.0, help="label smoothing")
    ap.add_argument("--blocks", default="2048:4096,4096:8192,8192:8192",
                    help="BLOCK:GRAD_BLOCK pairs (elements)")
    ap.add_argument("--stages", default="", help="also sweep num_stages, e.g. 1,2,3")
    ap.add_argument("--split", default="0,1",
                    help="SPLIT values: whole blocks without a mask, then the tail")
    ap.add_argument("--sum-in-grad", default="0,1",
                    help="SUM_IN_GRAD values (label smoothing: sum of logits in the second pass)")
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    results = []
    for spec in args.shapes.split(","):
        dims, _, dt = spec.partition("-")
        n, v = (int(d) for d in dims.split("x"))
        dtype = torch.float32 if dt == "fp32" else torch.bfloat16
        x = (torch.randn(n, v, device="cuda") * 3).to(dtype)
        t = torch.randint(0, v, (n,), device="cuda")
        t[::61] = -100  # a few ignored rows (they skip the second pass's arithmetic)
        loss, lse = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
        view = row_view(x)
        dview = like_rows(view)
        opts = LossOptions(0, v, -100, args.smoothing, 0.0)
        count = K.count(t, -100)
        bound_ms = 2 * dtype.itemsize * n * v / bw * 1e3
        # the default two passes, and their gradient as the reference for each config
        ref = like_rows(view)
        one = torch.ones((), device="cuda")

        def two_pass():
            K.forward(view, t, opts, None, loss, lse)
            K.backward(view, ref, t, lse, one, count, opts)

        two_pass()
        ms2 = triton.testing.do_bench(two_pass, warmup=5, rep=40)
        print(f"{spec}: two passes {ms2:.3f} ms = {ms2 / bound_ms:.3f}x the 4 B bound", flush=True)
        results.append(dict(shape=spec, impl="two_pass", ms=ms2, ratio=ms2 / bound_ms))
        vec = 16 // dtype.itemsize
        blocks = [tuple(int(b) for b in pair.split(":")) for pair in args.blocks.split(",")]
        sums = [int(x) for x in args.sum_in_grad.split(",")] if args.smoothing else [0]
        cfgs = [dict(BLOCK=b, VEC=vec, GRAD_BLOCK=gb, num_warps=w, programs_per_sm=p,
                     SPLIT=bool(sp), SUM_IN_GRAD=bool(sg), **({"num_stages": st} if st else {}))
                for st, (b, gb), w, p, sp, sg in itertools.product(
                    [int(x) for x in args.stages.split(",") if x] or [0], blocks,
                    [int(w) for w in args.warps.split(",")],
                    [int(p) for p in args.per_sm.split(",")],
                    [int(sp) for sp in args.split.split(",")], sums)]

        def run(cfg):
            fn = lambda: K.forward_grad(view, dview, t, loss, lse, count, opts, config=cfg)  # noqa: E731
            try:
                fn()
                ms = triton.testing.do_bench(fn, warmup=5, rep=30)
            except Exception as e:  # a config the compiler rejects
                print(f"{spec} {cfg} failed: {type(e).__name__}: {e}"[:300], flush=True)
                return None
            err = (dview.tensor.float() - ref.tensor.float()).abs().max().item()
            row = dict(shape=spec, impl="fused", **cfg, ms=ms, ratio=ms / bound_ms, grad_diff=err)
            results.append(row)
            return row

        best = None
        for cfg in cfgs:
            row = run(cfg)
            if row and (best is None or row["ms"] < best["ms"]):
                best = row
        print(f"best {spec}: {best}", flush=True)
        x = dview = ref = None
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bandwidth=bw, results=results), f, indent=1)


if __name__ == "__main__":
    main()
