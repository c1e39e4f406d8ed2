"""Fused linear cross entropy on one GPU, side by side with its peers.

    python benchmarks/bench_linear.py              # the table: N=16384, H=4096, V in {128256, 16032}
    python benchmarks/bench_linear.py --sweep      # tile sweep of ours first, then the table with the best
    python benchmarks/bench_linear.py --phases --sweep-vocab 16032 128256  # time per step first
    python benchmarks/bench_linear.py --impls ours@0.5 ours@1 ours@2 ours@3 liger  # the front
    python benchmarks/bench_linear.py --config '{"fwd_block_v": 128}' --impls ours
    TRITON_INTERPRET=1 python benchmarks/bench_linear.py --smoke-cpu --n 64 --hidden 32 --vocab 301

Each implementation runs forward + backward (``torch.autograd.grad`` of e and c) in bf16, for
``reduction="mean"``, for ``reduction="none"`` with a non-uniform per-token upstream gradient,
and for ``"masked"``: Megatron's loss, per-token losses times a loss mask, summed, divided by the
mask's count (ours given the mask, ``loss_mask=``, forms its gradients in forward where the
saved logits do not fit; the peers compute per-token losses).
Reported: median ms (CUDA events, L2 flushed before each call), TFLOP/s counted as 6NHV/time (a scalar loss can
form both gradients in forward) and 8NHV/time (per-token loss: logits recomputed in backward),
peak memory above the inputs during the step, with and without the gradients left behind, and
the loss error against an fp32 reference. Peers that are not importable are skipped with a note.
Results: ``benchmarks/results/linear_<device>_<time>.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import env, plots  # noqa: E402
from harness.errors import linear_reference_loss  # noqa: E402
from harness.peers.linear import (  # noqa: E402
    GiB, PEER_NOTES, PEERS, known, make_inputs, make_peer, make_step)
from harness.report import front, table, write_report  # noqa: E402
from harness.step import measure_with_grads  # noqa: E402
from harness.timing import Device, interleaved  # noqa: E402

env.use_checkout_package()

import linear_tuning as tuning  # noqa: E402
from vocab_parallel_loss.kernels.linear import config as C  # noqa: E402
from vocab_parallel_loss.kernels.linear import gemm as G  # noqa: E402

DEV: Device = None  # main(): the GPU, or the CPU with --smoke-cpu (plumbing under TRITON_INTERPRET=1)


def measure(fn, e, c, t, red, up, warmup, rep):
    return measure_with_grads(DEV, make_step(fn, e, c, t, red, up), warmup, rep)


def run_table(shapes, impls, reductions, warmup, rep, note_cfg, rounds=0):
    rows, notes = [], []
    for n, h, v in shapes:
        steps, shape_rows = {}, {}
        e, c, t, up = make_inputs(DEV.torch, n, h, v)
        ref = linear_reference_loss(e.detach(), c.detach(), t)
        for name in impls:
            try:
                fn = make_peer(name)
            except Exception as ex:  # not installed
                msg = f"{name}: skipped ({type(ex).__name__}: {ex})"
                if msg not in notes:
                    notes.append(msg)
                    print(msg, flush=True)
                continue
            for red in reductions:
                if name == "ours_gif" and red == "none":  # (scalar or masked losses only)
                    continue
                try:
                    ms, peak, gbytes, loss = measure(fn, e, c, t, red, up, warmup, rep)
                except Exception as ex:
                    msg = f"{name} V={v} {red}: failed ({type(ex).__name__}: {str(ex)[:300]})"
                    notes.append(msg)
                    print(msg, flush=True)
                    traceback.print_exc()
                    DEV.empty_cache()
                    continue
                want = ref.mean() if red == "mean" else ref
                err = (loss.reshape(want.shape) - want).abs().max().item()
                row = dict(impl=name, reduction=red, n=n, h=h, v=v, ms=round(ms, 3),
                           tflops_6nhv=round(6 * n * h * v / ms / 1e9, 1),
                           tflops_8nhv=round(8 * n * h * v / ms / 1e9, 1),
                           peak_extra_GiB=round(peak / GiB, 3),
                           peak_extra_minus_grads_GiB=round((peak - gbytes) / GiB, 3),
                           max_loss_err=err)
                rows.append(row)
                print(json.dumps(row), flush=True)
                DEV.empty_cache()
                if rounds:
                    steps[(name, red)] = make_step(fn, e, c, t, red, up)
                    shape_rows[(name, red)] = row
        if rounds and steps:
            for key, ms in interleaved(DEV, steps, rounds).items():
                row = shape_rows[key]
                row["ms_alone"] = row["ms"]
                row.update(ms=round(ms, 3), tflops_6nhv=round(6 * n * h * v / ms / 1e9, 1),
                           tflops_8nhv=round(8 * n * h * v / ms / 1e9, 1))
                print(json.dumps(row), flush=True)
            del steps, shape_rows
        del e, c, t, up, ref
        DEV.empty_cache()
    notes += [x for x in PEER_NOTES if x not in notes]
    return rows, notes


def markdown(rows, notes, meta):
    lines = [f"# Fused linear cross entropy, {meta['device']}", "",
             f"torch {meta['torch']}, triton {meta['triton']}, commit `{meta.get('commit')}`, "
             "bf16, fwd+bwd (dE and dC), "
             f"{meta['time']}. TFLOP/s: 6NHV/time (scalar loss) and 8NHV/time (per-token loss). "
             "Memory: peak above the inputs during the step; with and without the gradients "
             "left behind (dE + dC in bf16)."
             + (f" A GPU sleep of {meta['gpu_lead_us']:g} us is queued before each rep's flush, "
                "untimed: the GPU does not wait for the host to issue the step."
                if meta.get("gpu_lead_us") else "")
             + (f" ms: the median of {meta['rounds']} rounds that time every row once in turn."
                if meta.get("rounds") else ""), "",
             f"Our tile config: `{meta['config']}`", ""]
    lines += table(
        ["V", "reduction", "impl", "ms", "TFLOP/s 6NHV", "TFLOP/s 8NHV", "peak extra GiB",
         "minus grads GiB", "max loss err"],
        [[r["v"], r["reduction"], r["impl"], f"{r['ms']:.2f}", f"{r['tflops_6nhv']:.0f}",
          f"{r['tflops_8nhv']:.0f}", f"{r['peak_extra_GiB']:.3f}",
          f"{r['peak_extra_minus_grads_GiB']:.3f}", f"{r['max_loss_err']:.2e}"]
         for r in sorted(rows, key=lambda r: (-r["v"], r["reduction"], r["ms"]))])
    lines += ["", "Pareto front (time against peak extra memory less the gradients; every "
              "point that no other is both faster and leaner than):", ""]
    for key in sorted({(r["v"], r["reduction"]) for r in rows}, key=lambda k: (-k[0], k[1])):
        group = [r for r in rows if (r["v"], r["reduction"]) == key]
        pts = ", ".join(f"{r['impl']} {r['ms']:.2f} ms / {r['peak_extra_minus_grads_GiB']:.2f} GiB"
                        for r in front(group, "peak_extra_minus_grads_GiB", "ms"))
        lines.append(f"- V={key[0]} {key[1]}: {pts}")
    if notes:
        lines += ["", "Notes:"] + [f"- {x}" for x in notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16384, help="tokens")
    # not --h: the CUTLASS DSL (imported with quack) parses sys.argv at import and reads --h as --help
    ap.add_argument("--hidden", type=int, default=4096, help="hidden size H")
    ap.add_argument("--vocab", type=int, nargs="+", default=[128256, 16032])
    ap.add_argument("--impls", nargs="+",
                    default=["ours", "ours_saved", "ours_gif", "ours_recompute", "torch", "cce",
                             "liger", "quack"],
                    help=f"any of {', '.join(PEERS)}, or ours@G: ours with memory_budget G GiB")
    ap.add_argument("--reductions", nargs="+", default=["mean", "none", "masked"],
                    choices=["mean", "none", "masked"])
    ap.add_argument("--rounds", type=int, default=0,
                    help="then time every row once per round in turn, this many rounds; the "
                         "table's ms becomes the median over the rounds (ms_alone keeps the "
                         "first timing)")
    ap.add_argument("--gpu-lead-us", type=float, default=0.0,
                    help="a GPU sleep queued before each rep's flush, untimed, so that the host "
                         "issues a step while the GPU still has work (as inside a model's step)")
    ap.add_argument("--config", default=None, help="JSON of LCEConfig fields for ours")
    ap.add_argument("--sweep", action="store_true", help="sweep our tile configs first")
    ap.add_argument("--sweep-vocab", type=int, nargs="+", default=[16032])
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--phases", action="store_true",
                    help="time each step of the saved-tiles strategy first (--sweep-vocab)")
    ap.add_argument("--sweep-set", default="modes", choices=list(tuning.SWEEPS),
                    help="which list of config deltas --sweep runs")
    ap.add_argument("--warmup", type=int, default=25, help="ms of warm-up calls per measurement")
    ap.add_argument("--rep", type=int, default=200, help="ms of timed calls per measurement")
    ap.add_argument("--out", default=str(env.RESULTS), help="folder of the .json and .md")
    ap.add_argument("--smoke-cpu", action="store_true",
                    help="plumbing check on CPU (set TRITON_INTERPRET=1; use tiny --n/--hidden/--vocab)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    for name in args.impls:
        base, _, budget = name.partition("@")
        if not known(name):
            raise SystemExit(f"--impls: unknown {name!r}")
    global DEV
    DEV = Device("cpu" if args.smoke_cpu else "cuda", gpu_lead_us=args.gpu_lead_us)
    dev = DEV.torch
    if args.config:
        C.OVERRIDE_CONFIG = C.default_config(dev).replace(**json.loads(args.config))
    sweep_rows = []
    if args.sweep or args.sweep_only:
        for sv in args.sweep_vocab:
            sweep_rows += [dict(r, v=sv) for r in
                           tuning.sweep(DEV, args.n, args.hidden, sv, args.warmup, args.rep,
                                        tuning.SWEEPS[args.sweep_set])]
        plain = [r for r in sweep_rows if r["reduction"] == "none"]
        # the table's "ours" uses the best default-path config; ours_gif adds gif
        if plain and len(args.sweep_vocab) == 1:
            best = min(plain, key=lambda r: r["ms"])
            print(f"best sweep config: {json.dumps(best['delta'])} ({best['ms']} ms)", flush=True)
            C.OVERRIDE_CONFIG = C.default_config(dev).replace(**best["delta"])
    phase_rows = []
    if args.phases:
        for sv in args.sweep_vocab:
            phase_rows += tuning.phases(DEV, args.n, args.hidden, sv, args.warmup, args.rep)
    cfg = C.default_config(dev)
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = dict(env.environment(DEV), time=f"{now:%Y-%m-%d %H:%M} UTC",
                config=dataclasses.asdict(cfg), cublas_fp32_out=dict(G.TORCH_DTYPE_MM),
                gpu_lead_us=args.gpu_lead_us, rounds=args.rounds)
    if args.smoke_cpu:
        meta["device"] = "cpu-smoke"
    rows, notes = [], []
    if not args.sweep_only:
        shapes = [(args.n, args.hidden, v) for v in args.vocab]
        rows, notes = run_table(shapes, args.impls, args.reductions, args.warmup, args.rep,
                                cfg, args.rounds)
    meta["cublas_fp32_out"] = dict(G.TORCH_DTYPE_MM)  # after use: False where it fell back
    md = markdown(rows, notes, meta) + (tuning.sweep_markdown(sweep_rows) if sweep_rows else "")
    if phase_rows:
        md += tuning.phases_markdown(phase_rows)
    stem = Path(args.out) / f"linear_{meta['device'].replace(' ', '_').lower()}_{now:%Y%m%d-%H%M}"
    report = dict(meta=meta, rows=rows, notes=notes, sweep=sweep_rows, phases=phase_rows)
    written = write_report(stem, report, md, plot=plots.linear_front if rows else None)
    print(md)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return report


if __name__ == "__main__":
    main()
