"""The kernels over logits variant by variant (L2 eviction hints, in place against a new
buffer, launch configs, label smoothing): kernel time of each variant, in one process.

    python scripts/diag_inplace.py --out diag_inplace.json

Variants (``--only`` picks groups):
- ``fwd``: the per-token forward's reads (``LOAD_HINT``: ``evict_first`` before session 11,
  none since);
- ``bwd``: the backward's reads and writes, into a new buffer and into the logits;
- ``pair``: forward then backward, as a per-token training step runs them;
- ``fused``: the reduced loss's fused kernel (with its count kernel): second read and writes;
- ``after``: a 24 MiB buffer read twice right after the backward, to see whether reads kept
  in L2 (``evict_last``) crowd out the next kernel's data;
- ``fcfg``: the fused kernel writing in place, around its shipped config: every pair of second
  read and store hints, then warps x gradient block and the first pass's block (and the
  shipped config into a new buffer, for reference). A shape may end in ``-lsS`` (label
  smoothing S), e.g. ``--shapes 16384x32000-ls0.1 --only fcfg``;
- ``fcache``: the fused kernel in place with cache modifiers on its second read (``.cg``,
  ``.cv``, ``.ca``) or its stores (``.cg``, ``.cs``, ``.wt``), against the shipped config in
  place and into a new buffer;
- ``ls``: why label smoothing's per-token passes are slower than plain ones with nearly the
  same instruction count: the shipped forward and backward with smoothing 0 (plain), 1e-30 (the
  smoothing code with plain's values: the uniform term underflows) and 0.1;
- ``pcfg``: the per-token forward and backward around their shipped configs (block, warps),
  with the shape's options (``-lsS`` for label smoothing).

Every variant runs in each of ``--rounds`` rounds, in a rotated order, so drift of the machine
shows up as spread rather than as a difference. Each rep is flushed first: ``dirty`` zeroes
256 MiB (as bench.py, which leaves L2 full of dirty lines), ``clean`` then reads them back.
The in-place variants work on their own copy of the logits (their contents become gradients:
the time does not depend on the values). Ratios are to each variant's bytes at the copy
bandwidth of the same run (forward 2 B per element, backward and fused 4 B, pair 6 B).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from vocab_parallel_loss._layout import like_rows, row_view
from vocab_parallel_loss._options import LossOptions
from vocab_parallel_loss.kernels import cross_entropy as K

PLAIN_FWD, PLAIN_BWD = K.forward_config, K.backward_config


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


def timed(fn, reps: int, flush: torch.Tensor, clean: bool, after=None) -> float:
    """Median ms of ``fn``, or of ``after`` run right behind it when given."""
    fn()
    events = []
    for _ in range(reps):
        flush.zero_()
        if clean:
            flush.sum()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if after is None:
            s.record()
            fn()
        else:
            fn()
            s.record()
            after()
        e.record()
        events.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def hinted(plain, **hints):
    """A config function: ``plain``'s launch parameters with ``hints`` (hint constexprs, or
    any other launch parameter) over them."""
    return lambda v, dtype, *rest: dict(plain(v, dtype, *rest), **hints)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x16032,16384x32000,16384x128256")
    ap.add_argument("--only", default="fwd,bwd,pair,fused,after")  # fcfg, fcache, ls, pcfg: on request
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flush", default="dirty")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    groups = set(args.only.split(","))
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    follower = torch.ones(6 << 20, device="cuda")  # 24 MiB: fits in the 50 MB L2
    rows = []
    for shape in args.shapes.split(","):
        dims, _, ls = shape.partition("-ls")
        n, v = (int(d) for d in dims.split("x"))
        smoothing = float(ls or 0.0)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, v, generator=gen, device="cuda").mul_(2).bfloat16()
        x_inplace = x.clone()
        t = torch.randint(0, v, (n,), generator=gen, device="cuda")
        g = torch.rand(n, generator=gen, device="cuda").add_(0.5)
        opts = LossOptions(0, v, -100, smoothing, 0.0)
        loss = torch.empty(n, device="cuda")
        lse = torch.empty(n, device="cuda")
        view, view_inplace = row_view(x), row_view(x_inplace)
        K.forward(view, t, opts, None, loss, lse)
        dview = like_rows(view)

        def fwd(hint):
            def run():
                K.forward_config = hinted(PLAIN_FWD, LOAD_HINT=hint)
                K.forward(view, t, opts, None, loss, lse)
            return run

        def bwd(load, store, inplace):
            def run():
                K.backward_config = hinted(PLAIN_BWD, LOAD_HINT=load, STORE_HINT=store)
                src = view_inplace if inplace else view
                K.backward(src, src if inplace else dview, t, lse, g, None, opts)
            return run

        def pair(fwd_hint, load, store, inplace):
            first, second = fwd(fwd_hint), bwd(load, store, inplace)
            return lambda: (first(), second())

        def fused(second, store, inplace, **over):
            cfg = dict(K.fused_config(v, x.dtype, smoothing > 0, inplace), SECOND_HINT=second,
                       STORE_HINT=store)
            cfg.update(over)
            src = view_inplace if inplace else view

            def run():
                c = K.count(t, opts.ignore_index)
                K.forward_grad(src, src if inplace else dview, t, loss, lse, c, opts, config=cfg)
            return run

        def configured(which, o=opts, **over):
            """The per-token forward or backward with options ``o``, its config plus ``over``."""
            def run():
                K.forward_config = hinted(PLAIN_FWD, **over)
                K.backward_config = hinted(PLAIN_BWD, **over)
                if which == "fwd":
                    K.forward(view, t, o, None, loss, lse)
                else:
                    K.backward(view, dview, t, lse, g, None, o)
                K.forward_config, K.backward_config = PLAIN_FWD, PLAIN_BWD
            return run

        def smoothed(which, a):
            return configured(which, LossOptions(0, v, -100, a, 0.0))

        def read_twice():
            follower.sum()
            follower.sum()

        variants = []  # (group, name, bytes per element, fn, after)
        for h in ("evict_first", "", "evict_last"):
            variants.append(("fwd", f"load={h or '-'}", 2, fwd(h), None))
        for load in ("", "evict_last"):
            for store in ("", "evict_first", "evict_last"):
                for inplace in (False, True):
                    variants.append(("bwd", f"load={load or '-'} store={store or '-'} "
                                     f"{'inplace' if inplace else 'new'}", 4,
                                     bwd(load, store, inplace), None))
        for fh, load, inplace in [("evict_first", "", False), ("evict_first", "evict_last", False),
                                  ("", "evict_last", False), ("evict_first", "", True),
                                  ("evict_first", "evict_last", True)]:
            variants.append(("pair", f"fwd={fh or '-'} bwd_load={load or '-'} "
                             f"{'inplace' if inplace else 'new'}", 6,
                             pair(fh, load, "", inplace), None))
        for second in ("evict_first", ""):
            for store in ("", "evict_first"):
                for inplace in (False, True):
                    variants.append(("fused", f"second={second or '-'} store={store or '-'} "
                                     f"{'inplace' if inplace else 'new'}", 4,
                                     fused(second, store, inplace), None))
        shipped = K.fused_config(v, x.dtype, smoothing > 0, True)
        hints = dict(second=shipped["SECOND_HINT"], store=shipped["STORE_HINT"])
        new = K.fused_config(v, x.dtype, smoothing > 0, False)
        fcfg = [(dict(second=new["SECOND_HINT"], store=new["STORE_HINT"]), {}, False)]
        fcfg += [(dict(second=a, store=b), {}, True) for a in ("evict_first", "", "evict_last")
                 for b in ("", "evict_first", "evict_last")]
        fcfg += [(hints, dict(num_warps=w, GRAD_BLOCK=K._block(v, gb)), True)
                 for w in (4, 8, 16) for gb in (4096, 8192, 16384)
                 if (w, K._block(v, gb)) != (shipped["num_warps"], shipped["GRAD_BLOCK"])]
        fcfg += [(hints, dict(BLOCK=K._block(v, b)), True) for b in (4096, 8192, 16384)
                 if K._block(v, b) != shipped["BLOCK"]]
        for h, over, inplace in fcfg:
            label = " ".join(f"{k}={val}" for k, val in over.items())
            variants.append(("fcfg", f"second={h['second'] or '-'} store={h['store'] or '-'} "
                             f"{label} {'inplace' if inplace else 'new'}", 4,
                             fused(h["second"], h["store"], inplace, **over), None))
        # cache modifiers of the second read and of the stores, in place (session 13: only the
        # eviction policies had been swept), with the shipped config into a new buffer first.
        # PTX takes no eviction policy next to a cache modifier: the access then has none.
        fcache = [("", "", False), ("", "", True)]
        fcache += [(a, "", True) for a in (".cg", ".cv", ".ca")]
        fcache += [("", b, True) for b in (".cg", ".cs", ".wt")]
        for load_cache, store_cache, inplace in fcache:
            cfg = K.fused_config(v, x.dtype, smoothing > 0, inplace)
            second = "" if load_cache else cfg["SECOND_HINT"]
            store = "" if store_cache else cfg["STORE_HINT"]
            variants.append(("fcache", f"second={load_cache or second or '-'} "
                             f"store={store_cache or store or '-'} "
                             f"{'inplace' if inplace else 'new'}", 4,
                             fused(second, store, inplace, SECOND_CACHE=load_cache,
                                   STORE_CACHE=store_cache), None))
        for which in ("fwd", "bwd"):
            for a in (0.0, 1e-30, 0.1):
                variants.append(("ls", f"{which} smoothing={a:g}", 2 if which == "fwd" else 4,
                                 smoothed(which, a), None))
        for block, warps in [(None, None), (1024, 2), (1024, 4), (2048, 2), (2048, 8),
                             (4096, 4), (4096, 8)]:
            over = {} if block is None else dict(BLOCK=block, num_warps=warps)
            variants.append(("pcfg", f"fwd {over or 'shipped'}", 2, configured("fwd", **over),
                             None))
        for block, warps in [(None, None), (8192, 16), (16384, 8), (16384, 16), (16384, 32),
                             (4096, 16), (32768, 32)]:
            over = {} if block is None else dict(BLOCK=block, num_warps=warps)
            variants.append(("pcfg", f"bwd {over or 'shipped'}", 4, configured("bwd", **over),
                             None))
        for load in ("", "evict_last"):
            variants.append(("after", f"bwd_load={load or '-'}: 2x24 MiB read", 0,
                             bwd(load, "", False), read_twice))
        variants = [var for var in variants if var[0] in groups]

        modes = args.flush.split(",")
        times = {i: {m: [] for m in modes} for i in range(len(variants))}
        for r in range(args.rounds):
            k = (r * 7) % len(variants)
            for i in list(range(k, len(variants))) + list(range(k)):
                _, _, _, fn, after = variants[i]
                for mode in modes:
                    times[i][mode].append(timed(fn, args.reps, flush, mode == "clean", after))
        K.forward_config, K.backward_config = PLAIN_FWD, PLAIN_BWD
        for i, (group, name, per_elem, _, _) in enumerate(variants):
            bound_ms = per_elem * n * v / bw * 1e3 if per_elem else None
            for mode, ms in times[i].items():
                ratio = [m / bound_ms for m in ms] if bound_ms else None
                rows.append(dict(shape=shape, group=group, variant=name, flush=mode, ms=ms,
                                 ratio=ratio))
                cells = " ".join(f"{m * 1e3:8.1f} us" + (f" ({m / bound_ms:.3f})" if bound_ms
                                                          else "") for m in ms)
                print(f"{shape} {group:5s} {name:44s} {mode:5s} {cells}", flush=True)
        x = x_inplace = view = view_inplace = dview = variants = None  # free before the next shape
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(bandwidth=bw, reps=args.reps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
