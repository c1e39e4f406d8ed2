#!/usr/bin/env python
"""Tensor-parallel scaling of the vocab-parallel cross entropy, under torchrun.

Per rank: bf16 logits of shape ``(N, V / TP)`` (N = 16384 tokens per rank by default), for
V in {128256, 256000}. TP = the world size and, in the same launch, every power-of-two sub-group
size below it (1, 2, 4, ...; all sub-groups of one size run at the same time, as the TP groups of a
TP x DP job do). For each (V, TP) and implementation: forward, backward and total ms (median over
reps, CUDA events, L2 flushed, ranks aligned before each rep; the figure reported is the largest
per-rank median), and for this package also:

* ``kernel``: the same local shard with ``tp_group=None`` (targets taken modulo ``V / TP``): the
  single-shard kernel time, without any communication;
* ``collective``: ``vocab_parallel_loss.communication.gather_stats`` alone on the ``(4, N)`` fp32
  tensor (the one all-gather of the forward);
* the collective's share of our total, ``collective / kernel``, and ``ours / kernel - 1`` (the
  whole cost of TP end to end: collective, merge, skew). Target: collective / kernel
  <= 5 % at TP = 8.

Peers, each skipped with a note when it cannot run: megatron-core ``tensor_parallel.
vocab_parallel_cross_entropy`` (native) and ``fused_vocab_parallel_cross_entropy`` (fused), with
``parallel_state`` initialized for each TP size, and TransformerEngine's ``parallel_cross_entropy``
(``transformer_engine.pytorch``, or the ``te_triton_ce`` extract of it). Every peer's per-token
loss is compared with ours (largest absolute difference over ranks).

Rank 0 writes ``scaling.json``, ``scaling.md`` and (with matplotlib) ``scaling.png`` into
``--out-dir``; the JSON is rewritten after every (V, TP), so a run cut short keeps what it measured.

    torchrun --nproc-per-node 8 benchmarks/bench_scaling.py --out-dir DIR       # nccl, one GPU a rank
    torchrun --nproc-per-node 1 benchmarks/bench_scaling.py --out-dir DIR       # one GPU: TP = 1
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 benchmarks/bench_scaling.py --cpu-smoke --out-dir DIR

``--cpu-smoke``: gloo on CPU, tiny shapes, 2 reps: checks the whole pipeline, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Dict

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import dist, env, plots, probes  # noqa: E402
from harness.peers.logits import IMPLS, Case, Context, allow_many_graphs  # noqa: E402
from harness.report import finite, fmt, pct, ratio, reason, table, write_report  # noqa: E402
from harness.step import measure_aligned  # noqa: E402
from harness.timing import Device  # noqa: E402

dist.no_multicast()  # NVLink multicast off, whatever launched us (read when NCCL makes a group)
env.use_checkout_package()

TARGET = 0.05  # the collective adds <= 5 % over the single-shard kernel time at TP = 8
ALL_IMPLS = ["ours", "megatron_native", "megatron_fused", "te"]
# megatron's fused loss is built with jit_fuser = torch.compile: minutes of compilation on 2 CPUs
SMOKE_IMPLS = ["ours", "megatron_native"]


# ------------------------------------------------------------------------------------- setup
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=None,
                   help="default benchmarks/results/scaling-<UTC date>")
    p.add_argument("--vocab", type=str, default=None, help="comma-separated, default 128256,256000")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank, default 16384")
    p.add_argument("--tp", type=str, default=None,
                   help="comma-separated TP sizes (each must divide the world size); default: "
                        "1, 2, 4, ... up to the world size")
    p.add_argument("--impls", type=str, default=None,
                   help=f"comma-separated subset of {','.join(ALL_IMPLS)} (default: all; "
                        f"--cpu-smoke: {','.join(SMOKE_IMPLS)})")
    p.add_argument("--reps", type=int, default=None, help="timed reps (default 20; smoke 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed reps first (default 3; smoke 1)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="gloo on CPU, tiny shapes (V 256 and 1000, N 64), 2 reps")
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    a.vocab = [int(v) for v in (a.vocab or ("256,1000" if smoke else "128256,256000")).split(",")]
    a.tokens = a.tokens or (64 if smoke else 16384)
    a.impls = (a.impls.split(",") if a.impls else (SMOKE_IMPLS if smoke else ALL_IMPLS))
    unknown = set(a.impls) - set(ALL_IMPLS)
    if unknown:
        p.error(f"unknown --impls {sorted(unknown)}; choose from {ALL_IMPLS}")
    if "ours" not in a.impls:
        a.impls = ["ours"] + a.impls  # the reference of every comparison
    a.reps = a.reps or (2 if smoke else 20)
    a.warmup = a.warmup if a.warmup is not None else (1 if smoke else 3)
    if a.out_dir is None:
        a.out_dir = env.RESULTS / f"scaling-{datetime.datetime.utcnow():%Y%m%d}"
    return a


# ------------------------------------------------------------------------------------- timing
def impl_fn(name: str, ctx: Context, case: Case):
    """The peer's per-token fp32 loss ``fn(x (N, V_local), target (N,) global ids)``."""
    fn = IMPLS[name].make(ctx)
    return lambda x, t: fn(x, t, "none", case).reshape(-1)


# -------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    dev = dist.init_torchrun(args.cpu_smoke)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    clock = dist.AlignedDevice(dev)
    try:  # megatron's fused loss is torch.compile'd: one graph per shape, more than the default
        allow_many_graphs()
    except Exception:  # noqa: BLE001
        pass

    sizes = dist.tp_sizes(args.tp, world)
    # every rank creates every sub-group (collective), keeping its own
    groups = {}
    for t in sizes:
        groups[t] = tdist.group.WORLD if t == world else tdist.new_subgroups(group_size=t)[0]

    notes: Dict[str, str] = {}
    if "te" in args.impls and dev.type != "cuda":
        notes["te"] = "TransformerEngine's Triton kernels need a GPU: skipped on CPU"
    report = {
        "meta": meta(args, dev, world, sizes),
        "notes": notes,
        "results": [],
        "scaling": [],
    }
    out_dir = Path(args.out_dir)
    dtype = torch.bfloat16
    for t in sizes:
        # megatron's parallel_state once per TP size (it creates a dozen process groups)
        mg_group = None
        if any(i.startswith("megatron") for i in args.impls):
            mg_group = dist.megatron_agreed_group(t, notes, dev)
        for v in args.vocab:
            group = groups[t]
            v_local = -(-v // t)  # V padded up to a multiple of TP, as Megatron pads it
            n = args.tokens
            gen = torch.Generator().manual_seed(1000 + v)  # same targets on every rank
            target = torch.randint(0, v, (n,), generator=gen).to(dev)
            upstream = torch.rand(n, generator=gen).to(dev) + 0.5
            gen_x = torch.Generator(device=dev).manual_seed(17 * (rank + 1) + v)
            master = torch.randn(n, v_local, generator=gen_x, device=dev, dtype=dtype).mul_(2)
            # megatron_fused's remark on its jit_fuser is not part of this report
            ctx = Context(clock, group, mg_group, notes={})
            case = Case(n, v_local)
            rows = []

            def run(label, impl, fn, master_, target_, extra=None):
                try:
                    f, b, tot, loss = measure_aligned(clock, fn, master_, target_, upstream, args.reps,
                                                      args.warmup)
                    ok, err = True, None
                except Exception as e:  # noqa: BLE001
                    f = b = tot = math.nan
                    loss, ok, err = None, False, f"{type(e).__name__}: {e}"
                    print(f"rank {rank}: {label} failed at V={v} TP={t}", flush=True)
                    traceback.print_exc()
                rows.append(dict(label=label, impl=impl, fwd=f, bwd=b, total=tot, loss=loss,
                                 error=err, **(extra or {})))
                return ok

            # ours on the TP group, then the same shard alone (the single-shard kernel time)
            run("ours", "ours", impl_fn("ours", ctx, case), master, target)
            run("kernel", "ours", impl_fn("ours", Context(clock), case), master, target % v_local,
                extra={"note": "tp_group=None on the local shard"})
            coll = probes.measure_gather_stats(clock, group, n, args.reps, args.warmup)

            for impl in args.impls:
                if impl == "ours":
                    continue
                if impl.startswith("megatron") and mg_group is None:
                    notes.setdefault(impl, "megatron-core parallel_state could not be initialized")
                    continue
                if impl == "te" and dev.type != "cuda":
                    continue
                err = None
                try:
                    fn = impl_fn(impl, ctx, case)
                except Exception as e:  # noqa: BLE001 - mostly ImportError
                    err, fn = reason(e), None
                if not dist.all_agree(err is None, dev):
                    notes[impl] = f"skipped: {err or 'failed on another rank'}"
                    continue
                run(impl, impl, fn, master, target)

            ours_loss = rows[0]["loss"]
            # per-rank values -> max / min over ranks (every rank has every row, NaN if it failed)
            per_rank = []
            for r in rows:
                diff = math.nan
                if r["label"] not in ("ours", "kernel") and r["loss"] is not None and ours_loss is not None:
                    diff = float((r["loss"] - ours_loss).abs().max())
                per_rank += [r["fwd"], r["bwd"], r["total"], diff]
            per_rank.append(coll)
            agg = dist.over_ranks(per_rank, dev)
            hi, lo = agg["max"], agg["min"]
            entry_rows = []
            for i, r in enumerate(rows):
                fw, bw, tt, df = hi[4 * i:4 * i + 4]
                entry_rows.append(dict(
                    vocab=v, tp=t, v_local=v_local, tokens_per_rank=n, impl=r["label"],
                    fwd_ms=finite(fw), bwd_ms=finite(bw), total_ms=finite(tt),
                    total_ms_min_rank=finite(lo[4 * i + 2]),
                    max_abs_loss_diff_vs_ours=finite(df) if r["label"] not in ("ours", "kernel") else None,
                    error=r["error"], note=r.get("note")))
            coll_ms = hi[-1]
            report["results"] += entry_rows
            by = {e["impl"]: e for e in entry_rows}
            kernel, ours = by["kernel"]["total_ms"], by["ours"]["total_ms"]
            sc = dict(vocab=v, tp=t, v_local=v_local, tokens_per_rank=n,
                      kernel_single_shard_ms=kernel, ours_tp_ms=ours, collective_ms=finite(coll_ms),
                      collective_share_of_total=ratio(coll_ms, ours),
                      collective_over_kernel=ratio(coll_ms, kernel),
                      tp_overhead_end_to_end=(ratio(ours, kernel) - 1) if ratio(ours, kernel) is not None else None)
            sc["meets_target"] = (None if t == 1 or sc["collective_over_kernel"] is None
                                  else bool(sc["collective_over_kernel"] <= TARGET))
            for impl in args.impls[1:]:
                if impl in by and by[impl]["total_ms"] is not None and ours:
                    sc[f"{impl}_over_ours"] = by[impl]["total_ms"] / ours
            report["scaling"].append(sc)
            del master
            clock.empty_cache()
            if rank == 0:
                print(f"V={v} TP={t}: ours {ours} ms, kernel {kernel} ms, collective {coll_ms:.4f} ms "
                      f"({pct(sc['collective_over_kernel'])} of the kernel)", flush=True)
                write(_sorted(report), out_dir, final=False)
    dist.megatron_teardown()
    if rank == 0:
        write(_sorted(report), out_dir, final=True)
        print(f"bench_scaling: wrote {out_dir}/scaling.json on {world} ranks ({dev.type}, "
              f"{tdist.get_backend()})", flush=True)
    tdist.barrier()
    dist.close()
    return 0


def _sorted(report: dict) -> dict:
    """Rows by (V, TP), measured TP-major (one megatron-core initialization per TP size)."""
    key = lambda r: (r["vocab"], r["tp"])  # noqa: E731 - stable: impl order kept
    return dict(report, results=sorted(report["results"], key=key),
                scaling=sorted(report["scaling"], key=key))


def meta(args, dev, world, sizes) -> dict:
    env_ = env.environment(Device(dev, flush="none"))
    return dict(
        env_,
        date_utc=env_["time_utc"],
        device_type=dev.type, backend=tdist.get_backend(), world_size=world, tp_sizes=sizes,
        vocab=args.vocab, tokens_per_rank=args.tokens, dtype="bf16", reps=args.reps,
        warmup=args.warmup, cpu_smoke=bool(args.cpu_smoke), impls=args.impls,
        versions={"torch": torch.__version__, **{p: env.version(p) for p in sorted({IMPLS[i].package for i in ALL_IMPLS})}},
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
        env={k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                            "NVSHMEM_DISABLE_NVLS")},
        method=("per rank: bf16 logits (N, ceil(V/TP)) = randn*2, targets uniform in [0, V) (same on "
                "every rank), per-token loss, backward with a fixed fp32 upstream in [0.5, 1.5); "
                "logits restored, L2 flushed and all ranks aligned before each rep; median over "
                "reps per rank, then the max over ranks. kernel = ours with tp_group=None on the "
                "local shard (targets mod V/TP); collective = gather_stats on a (4, N) fp32 tensor"),
        target=f"collective / kernel <= {TARGET:.0%} at TP = 8",
    )


def write(report: dict, out_dir: Path, final: bool) -> None:
    """scaling.json and scaling.md, and at the end scaling.png (with matplotlib)."""
    write_report(out_dir / "scaling", report, markdown(report),
                 functools.partial(plots.scaling_curves, target=TARGET) if final else None)
    if final and "plot" in report["notes"]:  # the reason the plot is missing, in the table too
        (out_dir / "scaling.md").write_text(markdown(report))


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [
        f"# TP scaling of the vocab-parallel cross entropy ({m['device']}, {m['backend']}, "
        f"world {m['world_size']})",
        "",
        f"{m['date_utc']} UTC; commit {m['commit']}; versions: "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v) + ".",
        f"N = {m['tokens_per_rank']} tokens per rank, bf16, TP sizes {m['tp_sizes']}, "
        f"{m['reps']} reps after {m['warmup']} warm-up" + (" — **CPU smoke run, not a measurement**" if m["cpu_smoke"] else "") + ".",
        "",
        f"Method: {m['method']}.",
        "",
        f"## Collective vs single-shard kernel (target: {m['target']})",
        "",
    ]
    lines += table(
        ["V", "TP", "V/TP", "kernel, 1 shard (ms)", "ours on TP (ms)", "collective (ms)",
         "share of ours", "collective / kernel", "ours / kernel − 1", "target"],
        [[s["vocab"], s["tp"], s["v_local"], _f(s["kernel_single_shard_ms"]), _f(s["ours_tp_ms"]),
          _f(s["collective_ms"], ".4f"), pct(s["collective_share_of_total"]),
          pct(s["collective_over_kernel"]), pct(s["tp_overhead_end_to_end"]),
          "—" if s["meets_target"] is None else ("yes" if s["meets_target"] else "**no**")]
         for s in report["scaling"]], "rrrrrrrrrc")
    lines += ["", "## Forward / backward per implementation (max over ranks of the per-rank median)", ""]
    ours = {(r["vocab"], r["tp"]): r["total_ms"] for r in report["results"] if r["impl"] == "ours"}
    rows = []
    for r in report["results"]:
        o = ours.get((r["vocab"], r["tp"]))
        name = r["impl"] + (" (1 shard, no TP)" if r["impl"] == "kernel" else "")
        if r["error"]:
            name += f" — failed: {r['error'][:80]}"
        rows.append([r["vocab"], r["tp"], name, _f(r["fwd_ms"]), _f(r["bwd_ms"]), _f(r["total_ms"]),
                     _f(r["total_ms"] / o, ".2f") if r["total_ms"] is not None and o else "—",
                     _f(r["max_abs_loss_diff_vs_ours"], ".2e")])
    lines += table(["V", "TP", "implementation", "fwd (ms)", "bwd (ms)", "total (ms)", "total / ours",
                    "max abs loss diff vs ours"], rows, "rrlrrrrr")
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {k}: {v}" for k, v in report["notes"].items()]
    return "\n".join(lines) + "\n"


def _f(x, spec=".3f") -> str:
    return fmt(x, spec, "—")


if __name__ == "__main__":
    sys.exit(main())
