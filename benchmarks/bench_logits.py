#!/usr/bin/env python
"""Side-by-side benchmark of cross-entropy implementations over logits on one GPU.

Every implementation runs on the same inputs in the same process: this package (default and
``inplace_backward=True``), torch eager (input dtype, and cast to fp32), ``torch.compile`` of the
fp32 cast, megatron-core native and fused, TransformerEngine's Triton ``parallel_cross_entropy``
(default and ``overwrite_input=True``), Liger, quack (default and in-place) and apex xentropy.
Peers that cannot be imported are skipped with the reason, in the output as well. Shapes: five
bf16 shapes, then fp32 input, label smoothing 0.1 and z-loss 1e-4 on 16384 x 32000
(each only for the implementations that support it).

Two paths per shape: ``none`` (per-token loss, backward with a random non-uniform fp32 upstream
gradient through ``torch.autograd.grad``, as into an output layer) and ``mean`` (scalar loss,
backward with the implicit 1). For each: forward, backward and total ms (median over reps, CUDA
events, L2 flushed before each rep), the ratio to the memory bound ``B x N x V / BW`` (B = 6 bytes
per bf16 element per-token, 4 reduced, scaled by the element size; BW from a device-to-device copy
in the same run), the peak memory over the inputs in units of the logits' bytes (the gradient
left behind counted), and the largest loss and gradient error against an fp32 PyTorch reference.
Extras: the cost of the TP statistics collective on a 1-rank NCCL group, and the host overhead
of one forward of this package (eager, and CUDA graph replay).

Writes ``<gpu>-<date>.json``, ``.md`` and ``.png`` into ``--out-dir`` (default
``benchmarks/results``). The JSON is rewritten after every shape, so a run cut short keeps what
it measured.

    python benchmarks/bench_logits.py                 # full run on the GPU (about 5-6 minutes)
    python benchmarks/bench_logits.py --quick         # smoke run: small shapes, short timings
    python benchmarks/bench_logits.py --dry-run       # CPU, tiny shapes: checks the whole pipeline
    python benchmarks/bench_logits.py --shapes 16384x16032,16384x32000-fp32 --impls ours,liger --paths none
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import dist, env, errors, plots, probes  # noqa: E402
from harness.peers.logits import IMPLS, Case, Context, LossFn, allow_many_graphs, make_all  # noqa: E402
from harness.report import fmt, reason, slug, table, write_report  # noqa: E402
from harness.step import measure_budgeted  # noqa: E402
from harness.timing import Device  # noqa: E402

env.use_checkout_package()
log = env.log


# --------------------------------------------------------------------------------------- cases
# The shapes (N tokens x V_local): Llama-2 32K, Llama-3 128K, Gemma 256K, Llama-3 over TP8
# (128256 / 8 = 16032), and the same shard with 4x the tokens; then fp32 input, label smoothing
# and z-loss on one shape (each should be within 5% of bf16 per-token in bytes-normalised time).
FULL_CASES = [Case(16384, 32000), Case(16384, 128256), Case(8192, 256000), Case(16384, 16032),
              Case(65536, 16032), Case(16384, 32000, "fp32"), Case(16384, 32000, smoothing=0.1),
              Case(16384, 32000, z_loss=1e-4)]
QUICK_CASES = [Case(4096, 32000), Case(4096, 16032), Case(2048, 16032, "fp32"),
               Case(2048, 16032, smoothing=0.1), Case(2048, 16032, z_loss=1e-4)]
DRY_CASES = [Case(64, 1000), Case(48, 512, "fp32"), Case(48, 512, smoothing=0.1),
             Case(48, 512, z_loss=1e-4)]
PATHS = ("none", "mean")


# ---------------------------------------------------------------------------------- measuring
@dataclass
class Inputs:
    logits: torch.Tensor
    target: torch.Tensor
    g: torch.Tensor  # upstream gradient of the per-token loss: random, non-uniform, fp32

    @staticmethod
    def make(case: Case, dev: Device, seed: int = 0) -> "Inputs":
        gen = torch.Generator(device=dev.torch).manual_seed(seed)
        logits = torch.randn(case.n, case.v, generator=gen, device=dev.torch,
                             dtype=torch.float32).mul_(2.0).to(case.torch_dtype)
        target = torch.randint(0, case.v, (case.n,), generator=gen, device=dev.torch)
        g = torch.rand(case.n, generator=gen, device=dev.torch).add_(0.5)
        return Inputs(logits, target, g)


@dataclass
class Result:
    impl: str
    case: str
    path: str
    n: int
    v: int
    dtype: str
    smoothing: float
    z_loss: float
    status: str = "ok"  # ok | skipped | error
    note: str = ""
    fwd_ms: Optional[float] = None
    bwd_ms: Optional[float] = None
    total_ms: Optional[float] = None
    reps: int = 0
    bound_ms: Optional[float] = None
    ratio: Optional[float] = None
    ratio_6b: Optional[float] = None  # mean path: vs the per-token bound (row not kept on chip)
    bw_fraction: Optional[float] = None
    peak_extra_bytes: Optional[int] = None
    mem_x_logits: Optional[float] = None
    loss_err: Optional[float] = None
    grad_err: Optional[float] = None
    loss_dtype: Optional[str] = None
    sm_clock_mhz: Optional[int] = None  # mid-way through the timed reps


def bytes_per_element(case: Case, path: str) -> int:
    """Minimal HBM traffic: per-token read + read + write (3 x elsize), reduced read + write."""
    elsize = torch.empty((), dtype=case.torch_dtype).element_size()
    return (3 if path == "none" else 2) * elsize


def run_one(fn: LossFn, case: Case, path: str, inp: Inputs, ref: tuple, dev: Device,
            cfg: argparse.Namespace, res: Result) -> None:
    def backward(loss, x):
        if path == "none":
            go = inp.g if loss.dtype == inp.g.dtype else inp.g.to(loss.dtype)
            return torch.autograd.grad(loss, x, go)[0]
        return torch.autograd.grad(loss, x)[0]

    out = measure_budgeted(dev, lambda x: fn(x, inp.target, path, case), backward, inp.logits,
                           ref, cfg.warmup, cfg.min_reps, cfg.max_reps, cfg.budget)
    for k, v in out.items():
        setattr(res, k, v)
    if res.peak_extra_bytes is not None:
        res.mem_x_logits = res.peak_extra_bytes / inp.logits.nbytes


# ------------------------------------------------------------------------------------- output
def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"# Cross-entropy benchmark: {m['device']} ({m['date']})", "",
             f"torch {m['torch']}, triton {m['triton']}, commit `{m['commit']}`, sources "
             f"`{m['source_hash']}`. Copy bandwidth {report['hbm']['copy_TBps']:.3f} TB/s "
             "(read + write). Ratio = total / (B x N x V / BW), B = 6 B/element per-token and "
             "4 B reduced for bf16 (x2 for fp32); mem = peak over the inputs, gradient left "
             "behind included, in units of the logits' bytes; errors are max abs vs an fp32 "
             "PyTorch reference." + (" L2 flush: clean (its write-back is not timed)."
                                     if m.get("flush") == "clean" else "")
             + (f" A GPU sleep of {m['gpu_lead_us']:g} us is queued before each rep's flush, "
                "untimed." if m.get("gpu_lead_us") else ""), "",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v) + ".", ""]
    notes = [f"- {k}: {v}" for k, v in report.get("notes", {}).items()]
    lines += notes + [""] * bool(notes)
    results = [r for r in report["results"] if r["status"] == "ok"]
    cases = list(dict.fromkeys(r["case"] for r in report["results"]))
    for path_name in PATHS:
        rows = [r for r in results if r["path"] == path_name]
        if not rows:
            continue
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        title = "per-token loss, non-uniform upstream gradient" if path_name == "none" else "mean loss"
        lines += [f"## Ratio to the bound: {title}", ""]
        lines += table(["impl", *cases], [
            [impl, *(fmt(by_case[c]["ratio"], ".2f") if c in by_case else "-" for c in cases)]
            for impl in impls for by_case in [{r["case"]: r for r in rows if r["impl"] == impl}]])
        mean = path_name == "mean"
        lines += ["", f"## Details: {title}", ""]
        lines += table(
            ["impl", "shape", "fwd ms", "bwd ms", "total ms", "ratio", *["ratio vs 6 B"] * mean,
             "mem", "loss err", "grad err", "reps"],
            [[r["impl"], r["case"], fmt(r["fwd_ms"], ".3f"), fmt(r["bwd_ms"], ".3f"),
              fmt(r["total_ms"], ".3f"), fmt(r["ratio"], ".2f"),
              *[fmt(r["ratio_6b"], ".2f")] * mean, fmt(r["mem_x_logits"], ".2f"),
              fmt(r["loss_err"], ".1e"), fmt(r["grad_err"], ".1e"), r["reps"]] for r in rows])
        lines.append("")
    others = [r for r in report["results"] if r["status"] != "ok"]
    if report["skipped"] or others:
        lines += ["## Not measured", ""]
        lines += [f"- {k}: {v}" for k, v in report["skipped"].items()]
        grouped: Dict[tuple, list] = {}
        for r in others:
            grouped.setdefault((r["impl"], r["status"], r["note"]), []).append(f"{r['case']} ({r['path']})")
        lines += [f"- {impl}: {status}: {note}: {', '.join(where)}"
                  for (impl, status, note), where in grouped.items()]
        lines.append("")
    lines += probes.markdown(report)
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- main
def _shapes(spec: str) -> list:
    try:
        return [Case.parse(x) for x in spec.split(",") if x]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: small shapes, short timings")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, CPU-capable impls only: checks the pipeline")
    p.add_argument("--shapes", type=_shapes,
                   help="comma list of NxV[-fp32][-ls0.1][-z1e-4] (default: the full shapes)")
    p.add_argument("--impls", type=lambda s: [x for x in s.split(",") if x],
                   help=f"comma list from: {', '.join(IMPLS)}")
    p.add_argument("--paths", type=lambda s: [x for x in s.split(",") if x], default=list(PATHS),
                   help="none,mean (default both)")
    p.add_argument("--out-dir", type=Path, help="default benchmarks/results (dry run: a temp dir)")
    p.add_argument("--budget", type=float, help="seconds of timed reps per measurement")
    p.add_argument("--min-reps", type=int)
    p.add_argument("--max-reps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--bw-gib", type=float, default=2.0, help="copy buffer for the bandwidth")
    p.add_argument("--no-extras", action="store_true", help="skip collective and host overhead")
    p.add_argument("--flush", choices=("dirty", "clean"), default="dirty",
                   help="L2 before each rep: zeroed 256 MiB left dirty (default, as do_bench), "
                        "or that followed by an untimed read so its write-back is not timed")
    p.add_argument("--gpu-lead-us", type=float, default=0.0,
                   help="queue a GPU sleep of this long before each rep's flush, so host time "
                        "cannot leak into the GPU timings of short steps (default 0: off)")
    p.add_argument("--max-seconds", type=float,
                   help="stop starting new shapes after this many seconds (results so far are kept)")
    args = p.parse_args(argv)
    for k in args.paths:
        if k not in PATHS:
            p.error(f"unknown path {k!r}")
    for k in args.impls or []:
        if k not in IMPLS:
            p.error(f"unknown impl {k!r}; known: {', '.join(IMPLS)}")
    mode = "dry" if args.dry_run else "quick" if args.quick else "full"
    defaults = {"full": (0.3, 10, 200, 3), "quick": (0.05, 5, 50, 2), "dry": (0.02, 3, 5, 1)}[mode]
    for k, d in zip(("budget", "min_reps", "max_reps", "warmup"), defaults):
        if getattr(args, k) is None:
            setattr(args, k, d)
    args.mode = mode
    if args.shapes is None:
        args.shapes = {"full": FULL_CASES, "quick": QUICK_CASES, "dry": DRY_CASES}[mode]
    if args.out_dir is None:
        args.out_dir = Path("/tmp/vpl-bench-dry") if args.dry_run else env.RESULTS
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --dry-run for the CPU pipeline check")
    dev = Device("cpu" if args.dry_run else "cuda", args.flush, args.gpu_lead_us)
    allow_many_graphs()
    ctx = Context(dev)
    start = time.perf_counter()
    meta = env.environment(dev)
    stem = args.out_dir / (f"{slug(dev.name())}-{meta['date']}"
                           + ("-quick" if args.quick else "")
                           + ("-clean-l2" if args.flush == "clean" else "")
                           + ("-gpu-lead" if args.gpu_lead_us else ""))

    fns, skipped = make_all(args.impls or list(IMPLS), ctx, dev.cuda)
    for name, why in skipped.items():
        log(f"skip {name}: {why}")
    log(f"vocab_parallel_loss from {meta['package_dir']}")

    report = {
        "meta": {**meta, "device_slug": slug(dev.name()), "mode": args.mode,
                 "flush": args.flush, "gpu_lead_us": args.gpu_lead_us,
                 "versions": {n: env.version(IMPLS[n].package) for n in fns},
                 "settings": {k: getattr(args, k) for k in ("budget", "min_reps", "max_reps", "warmup")},
                 "cases": [c.name for c in args.shapes], "paths": args.paths,
                 "upstream_grad": "per-token: uniform [0.5, 1.5) fp32; mean: implicit 1",
                 "logits": "randn * 2, rounded to the input dtype; targets uniform"},
        "notes": ctx.notes, "skipped": skipped, "hbm": {}, "collective": {}, "host_overhead": {}, "results": [],
    }

    def save():  # matplotlib is optional: the JSON and the table are written without it
        return write_report(stem, report, markdown(report), plots.logits_bandwidth)

    report["hbm"] = probes.measure_bandwidth(dev, args.bw_gib)
    bw = report["hbm"]["copy_TBps"] * 1e12
    log(f"{dev.name()}: copy bandwidth {report['hbm']['copy_TBps']:.3f} TB/s")
    if not args.no_extras:
        report.update(probes.measure_extras(dev, log))

    for case in args.shapes:
        if args.max_seconds and time.perf_counter() - start > args.max_seconds:
            log(f"--max-seconds reached: {case.name} not run")
            report["skipped"][f"shape {case.name}"] = "--max-seconds reached"
            continue
        inp = Inputs.make(case, dev)
        for path in args.paths:
            ref = errors.logits_reference(inp.logits, inp.target, inp.g if path == "none" else None,
                                         case.smoothing, case.z_loss)
            bound_ms = bytes_per_element(case, path) * case.n * case.v / bw * 1e3
            for name, fn in fns.items():
                res = Result(name, case.name, path, case.n, case.v, case.dtype, case.smoothing,
                             case.z_loss, bound_ms=bound_ms)
                why = IMPLS[name].skip_reason(case, dev.cuda)
                if why:
                    res.status, res.note = "skipped", why
                else:
                    try:
                        run_one(fn, case, path, inp, ref, dev, args, res)
                        res.ratio = res.total_ms / bound_ms
                        res.ratio_6b = res.total_ms / (bytes_per_element(case, "none") * case.n
                                                       * case.v / bw * 1e3)
                        res.bw_fraction = 1.0 / res.ratio
                        log(f"{case.name:>20} {path:4} {name:16} fwd {res.fwd_ms:8.3f} bwd "
                            f"{res.bwd_ms:8.3f} total {res.total_ms:8.3f} ms  ratio {res.ratio:5.2f}  "
                            f"mem {fmt(res.mem_x_logits, '.2f'):>5}  err {res.loss_err:.1e}/{res.grad_err:.1e}"
                            + (f"  sm {res.sm_clock_mhz} MHz" if res.sm_clock_mhz else ""))
                    except Exception as e:
                        res.status = "error"
                        res.note = reason(e, first_line=True)[:300]
                        log(f"{case.name:>20} {path:4} {name:16} ERROR {res.note}")
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                report["results"].append(asdict(res))
                dev.empty_cache()
            del ref
        del inp
        save()
    written = save()
    dist.close()
    log(f"wrote {', '.join(str(p) for p in written)}")
    return report


if __name__ == "__main__":
    main()
