"""Why is the in-place gradient slower than a new buffer? Kernel time of the backward and of the
fused reduced kernel, writing into the logits or into a new buffer, under L2 eviction hints.

    python scripts/diag_inplace.py --out diag_inplace.json

Every variant runs in each of ``--rounds`` rounds, in a rotated order, so drift of the machine
shows up as spread rather than as a difference. Each rep is flushed first: ``dirty`` zeroes
256 MiB (as bench.py, which leaves L2 full of dirty lines), ``clean`` then reads them back.
The in-place variants work on their own copy of the logits (their contents become gradients:
the time does not depend on the values). Ratios are to each kernel's bytes (both read 2 B and
write 2 B per element) at the copy bandwidth of the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from vocab_parallel_loss._layout import like_rows, row_view
from vocab_parallel_loss._options import LossOptions
from vocab_parallel_loss.kernels import cross_entropy as K

HINTS = [("", ""), ("evict_first", ""), ("evict_last", ""), ("", "evict_first"),
         ("evict_first", "evict_first")]


def copy_bandwidth() -> float:
    a = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return 2 * a.numel() / (statistics.median(times) * 1e-3)


def timed(fn, reps: int, flush: torch.Tensor, clean: bool) -> float:
    fn()
    events = []
    for _ in range(reps):
        flush.zero_()
        if clean:
            flush.sum()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x16032,16384x32000")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flush", default="dirty,clean")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    plain_bwd_config = K.backward_config
    rows = []
    for shape in args.shapes.split(","):
        n, v = (int(d) for d in shape.split("x"))
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, v, generator=gen, device="cuda").mul_(2).bfloat16()
        x_inplace = x.clone()
        t = torch.randint(0, v, (n,), generator=gen, device="cuda")
        g = torch.rand(n, generator=gen, device="cuda").add_(0.5)
        opts = LossOptions(0, v, -100, 0.0, 0.0)
        loss = torch.empty(n, device="cuda")
        lse = torch.empty(n, device="cuda")
        view, view_inplace = row_view(x), row_view(x_inplace)
        K.forward(view, t, opts, None, loss, lse)
        dview = like_rows(view)
        bytes_moved = 4 * n * v  # both kernels: read 2 B and write 2 B per element
        variants = []
        for hint in HINTS:
            for inplace in (False, True):
                def bwd(hint=hint, src=view_inplace if inplace else view,
                        dst=view_inplace if inplace else dview):
                    cfg = dict(plain_bwd_config(v, torch.bfloat16), LOAD_HINT=hint[0],
                               STORE_HINT=hint[1])
                    K.backward_config = lambda *_a: cfg
                    K.backward(src, dst, t, lse, g, None, opts)
                variants.append((("backward", hint[0] or "-", hint[1] or "-", inplace), bwd))
        for store_hint in ("", "evict_first"):
            cfg = dict(K.fused_config(v, x.dtype), STORE_HINT=store_hint)
            for inplace in (False, True):
                def fused(src=view_inplace if inplace else view,
                          dst=view_inplace if inplace else dview, cfg=cfg):
                    c = K.count(t, opts.ignore_index)
                    K.forward_grad(src, dst, t, loss, lse, c, opts, config=cfg)
                variants.append((("fused_mean", "evict_first", store_hint or "-", inplace), fused))
        times = {key: {m: [] for m in args.flush.split(",")} for key, _ in variants}
        for r in range(args.rounds):
            k = r % len(variants)
            for key, fn in variants[k:] + variants[:k]:
                for mode in args.flush.split(","):
                    times[key][mode].append(timed(fn, args.reps, flush, mode == "clean"))
        K.backward_config = plain_bwd_config
        bound_ms = bytes_moved / bw * 1e3
        for key, by_mode in times.items():
            for mode, ms in by_mode.items():
                row = dict(shape=shape, kernel=key[0], load_hint=key[1], store_hint=key[2],
                           inplace=key[3], flush=mode, ms=ms, ratio=[m / bound_ms for m in ms])
                rows.append(row)
                print(f"{shape} {key[0]:10s} load {key[1]:11s} store {key[2]:11s} "
                      f"{'inplace' if key[3] else 'new    '} {mode:5s} "
                      + " ".join(f"{m * 1e3:7.1f} us ({m / bound_ms:.3f})" for m in ms),
                      flush=True)
        del x, x_inplace, view, view_inplace, dview
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bandwidth=bw, reps=args.reps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
