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
import gc
import importlib
import math
import os
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional

# NVLink multicast stays off, whatever launched us; read when NCCL creates a communicator
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
from _common import Device  # noqa: E402

common.use_checkout_package()

from vocab_parallel_loss import communication, cross_entropy  # noqa: E402

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
        a.out_dir = common.RESULTS / f"scaling-{datetime.datetime.utcnow():%Y%m%d}"
    return a


def init(args):
    """torch.distributed from torchrun's environment: nccl on GPU, gloo on CPU (or --cpu-smoke)."""
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(k, v)
    use_cuda = torch.cuda.is_available() and not args.cpu_smoke
    if use_cuda:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", device_id=dev, timeout=datetime.timedelta(minutes=10))
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return dev


def tp_sizes(args, world: int) -> List[int]:
    if args.tp:
        sizes = sorted({int(t) for t in args.tp.split(",")})
        bad = [t for t in sizes if t < 1 or world % t]
        if bad:
            raise SystemExit(f"--tp {bad}: each TP size must divide the world size {world}")
        return sizes
    sizes, t = [], 1
    while t <= world:
        if world % t == 0:
            sizes.append(t)
        t *= 2
    return sorted(set(sizes) | {world})


class Clock(Device):
    """The benchmarks' clock, with every rank of the world aligned before each timed rep."""

    def __init__(self, dev: torch.device):
        super().__init__(dev)
        self._one = torch.zeros(1, device=self.torch)

    def align(self) -> None:
        """Evict L2, then line every rank of the world up (all sub-groups start together)."""
        self.flush_l2()
        dist.all_reduce(self._one)
        self.sync()


# ----------------------------------------------------------------------------- implementations
# make(ctx) -> fn(x (N, V_local), target (N,) global ids) -> per-token fp32 loss (N,)
def _ours(ctx):
    g = ctx["group"]
    return lambda x, t: cross_entropy(x, t, tp_group=g, reduction="none")


def _megatron_native(ctx):
    from megatron.core import tensor_parallel

    # [s, b, v] logits, [s, b] targets, TP group from parallel_state; it works in place on its
    # input (the caller restores the logits before every rep)
    return lambda x, t: tensor_parallel.vocab_parallel_cross_entropy(
        x.unsqueeze(1), t.unsqueeze(1)).reshape(-1)


def _megatron_fused(ctx):
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    g = ctx["megatron_group"]
    return lambda x, t: fused_vocab_parallel_cross_entropy(x.unsqueeze(1), t.unsqueeze(1), g).reshape(-1)


def _te(ctx):
    try:
        from transformer_engine.pytorch import parallel_cross_entropy
    except ImportError:
        # TE's Triton loss extracted unchanged into the te-triton-ce wheel (no TE C++ wheel for
        # every torch / CUDA)
        from te_triton_ce import parallel_cross_entropy
    g = ctx["group"]
    return lambda x, t: parallel_cross_entropy(x.unsqueeze(0), t.unsqueeze(0), 0.0, False, g).reshape(-1)


MAKERS: Dict[str, Callable] = {"ours": _ours, "megatron_native": _megatron_native,
                               "megatron_fused": _megatron_fused, "te": _te}
PACKAGES = {"ours": "vocab_parallel_loss", "megatron_native": "megatron-core",
            "megatron_fused": "megatron-core", "te": "transformer-engine"}


def all_agree(ok: bool, dev) -> bool:
    """True on every rank iff ``ok`` on every rank (decisions that gate collectives must agree)."""
    flag = torch.tensor([1.0 if ok else 0.0], device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def over_ranks(values: List[float], dev) -> Dict[str, List[float]]:
    """Max and min over all ranks of each value (NaN for a rank that has none)."""
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    hi, lo = t.clone(), t.clone()
    hi = torch.nan_to_num(hi, nan=-math.inf)
    lo = torch.nan_to_num(lo, nan=math.inf)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return {"max": hi.tolist(), "min": lo.tolist()}


# ------------------------------------------------------------------------------------- timing
def time_loss(fn, master, target, upstream, clock: Clock, reps: int, warmup: int):
    """Median fwd / bwd / total ms of ``fn`` on fresh copies of ``master``, and its last loss."""
    x = master.clone().requires_grad_()
    fwd, bwd, tot = [], [], []
    loss_out = None
    for i in range(warmup + reps):
        with torch.no_grad():
            x.copy_(master)  # peers that work in place on their input get the same logits
        clock.align()
        a = clock.stamp()
        loss = fn(x, target)
        b = clock.stamp()
        (grad,) = torch.autograd.grad(loss, x, upstream.to(loss.dtype).reshape(loss.shape))
        c = clock.stamp()
        clock.sync()
        if i >= warmup:
            fwd.append(clock.ms(a, b))
            bwd.append(clock.ms(b, c))
            tot.append(clock.ms(a, c))
        loss_out = loss.detach().float().reshape(-1)
        del loss, grad
    del x
    return statistics.median(fwd), statistics.median(bwd), statistics.median(tot), loss_out


def time_collective(group, n_rows: int, dev, clock: Clock, reps: int, warmup: int) -> float:
    # the forward's send buffer: (4, N) statistics and the shard's shapes
    stats = torch.randn(communication.stats_size(4, n_rows), dtype=torch.float32, device=dev)
    ts = []
    for i in range(warmup + reps):
        clock.align()
        a = clock.stamp()
        communication.gather_stats(stats, group)
        b = clock.stamp()
        clock.sync()
        if i >= warmup:
            ts.append(clock.ms(a, b))
    return statistics.median(ts)


# -------------------------------------------------------------------------------------- main
def megatron_init(tp: int, notes: Dict[str, str], dev):
    """parallel_state for this TP size on every rank; its TP group, or None (with a note)."""
    err = None
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        group = parallel_state.get_tensor_model_parallel_group()
    except Exception as e:  # noqa: BLE001 - any failure: skip the megatron peers with a note
        err, group = f"{type(e).__name__}: {e}", None
    if not all_agree(err is None, dev):
        notes[f"megatron_tp{tp}"] = f"megatron-core parallel_state failed at TP={tp}: {err or 'on another rank'}"
        return None
    return group


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = init(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    clock = Clock(dev)
    try:  # megatron's fused loss is torch.compile'd: one graph per shape, more than the default
        dyn = importlib.import_module("torch._dynamo").config
        dyn.cache_size_limit = max(dyn.cache_size_limit, 64)
        dyn.accumulated_cache_size_limit = max(dyn.accumulated_cache_size_limit, 512)
    except Exception:  # noqa: BLE001
        pass

    sizes = tp_sizes(args, world)
    # every rank creates every sub-group (collective), keeping its own
    groups = {}
    for t in sizes:
        groups[t] = dist.group.WORLD if t == world else dist.new_subgroups(group_size=t)[0]

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
            mg_group = megatron_init(t, notes, dev)
        for v in args.vocab:
            group = groups[t]
            v_local = -(-v // t)  # V padded up to a multiple of TP, as Megatron pads it
            n = args.tokens
            gen = torch.Generator().manual_seed(1000 + v)  # same targets on every rank
            target = torch.randint(0, v, (n,), generator=gen).to(dev)
            upstream = torch.rand(n, generator=gen).to(dev) + 0.5
            gen_x = torch.Generator(device=dev).manual_seed(17 * (rank + 1) + v)
            master = torch.randn(n, v_local, generator=gen_x, device=dev, dtype=dtype).mul_(2)
            ctx = {"group": group, "megatron_group": None}
            rows = []

            def run(label, impl, fn, master_, target_, extra=None):
                try:
                    f, b, tot, loss = time_loss(fn, master_, target_, upstream, clock, args.reps, args.warmup)
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
            run("ours", "ours", _ours(ctx), master, target)
            run("kernel", "ours", _ours({"group": None}), master, target % v_local,
                extra={"note": "tp_group=None on the local shard"})
            coll = time_collective(group, n, dev, clock, args.reps, args.warmup)

            for impl in args.impls:
                if impl == "ours":
                    continue
                if impl.startswith("megatron") and mg_group is None:
                    notes.setdefault(impl, "megatron-core parallel_state could not be initialized")
                    continue
                if impl == "te" and dev.type != "cuda":
                    continue
                ctx["megatron_group"] = mg_group
                err = None
                try:
                    fn = MAKERS[impl](ctx)
                except Exception as e:  # noqa: BLE001 - mostly ImportError
                    err, fn = f"{type(e).__name__}: {e}", None
                if not all_agree(err is None, dev):
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
            agg = over_ranks(per_rank, dev)
            hi, lo = agg["max"], agg["min"]
            entry_rows = []
            for i, r in enumerate(rows):
                fw, bw, tt, df = hi[4 * i:4 * i + 4]
                entry_rows.append(dict(
                    vocab=v, tp=t, v_local=v_local, tokens_per_rank=n, impl=r["label"],
                    fwd_ms=_num(fw), bwd_ms=_num(bw), total_ms=_num(tt),
                    total_ms_min_rank=_num(lo[4 * i + 2]),
                    max_abs_loss_diff_vs_ours=_num(df) if r["label"] not in ("ours", "kernel") else None,
                    error=r["error"], note=r.get("note")))
            coll_ms = hi[-1]
            report["results"] += entry_rows
            by = {e["impl"]: e for e in entry_rows}
            kernel, ours = by["kernel"]["total_ms"], by["ours"]["total_ms"]
            sc = dict(vocab=v, tp=t, v_local=v_local, tokens_per_rank=n,
                      kernel_single_shard_ms=kernel, ours_tp_ms=ours, collective_ms=_num(coll_ms),
                      collective_share_of_total=_ratio(coll_ms, ours),
                      collective_over_kernel=_ratio(coll_ms, kernel),
                      tp_overhead_end_to_end=(_ratio(ours, kernel) - 1) if _ratio(ours, kernel) is not None else None)
            sc["meets_target"] = (None if t == 1 or sc["collective_over_kernel"] is None
                                  else bool(sc["collective_over_kernel"] <= TARGET))
            for impl in args.impls[1:]:
                if impl in by and by[impl]["total_ms"] is not None and ours:
                    sc[f"{impl}_over_ours"] = by[impl]["total_ms"] / ours
            report["scaling"].append(sc)
            del master
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 0:
                print(f"V={v} TP={t}: ours {ours} ms, kernel {kernel} ms, collective {coll_ms:.4f} ms "
                      f"({_fmt_pct(sc['collective_over_kernel'])} of the kernel)", flush=True)
                write(_sorted(report), out_dir, final=False)
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    except Exception:  # noqa: BLE001
        pass
    if rank == 0:
        write(_sorted(report), out_dir, final=True)
        print(f"bench_scaling: wrote {out_dir}/scaling.json on {world} ranks ({dev.type}, "
              f"{dist.get_backend()})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _sorted(report: dict) -> dict:
    """Rows by (V, TP), measured TP-major (one megatron-core initialization per TP size)."""
    key = lambda r: (r["vocab"], r["tp"])  # noqa: E731 - stable: impl order kept
    return dict(report, results=sorted(report["results"], key=key),
                scaling=sorted(report["scaling"], key=key))


def _num(x) -> Optional[float]:
    return None if x is None or not math.isfinite(x) else float(x)


def _ratio(a, b) -> Optional[float]:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b <= 0:
        return None
    return a / b


def _fmt_pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def meta(args, dev, world, sizes) -> dict:
    env = common.environment(Device(dev, flush="none"))
    return dict(
        env,
        date_utc=env["time_utc"],
        device_type=dev.type, backend=dist.get_backend(), world_size=world, tp_sizes=sizes,
        vocab=args.vocab, tokens_per_rank=args.tokens, dtype="bf16", reps=args.reps,
        warmup=args.warmup, cpu_smoke=bool(args.cpu_smoke), impls=args.impls,
        versions={"torch": torch.__version__, **{p: common.version(p) for p in sorted(set(PACKAGES.values()))}},
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
    common.write_report(out_dir / "scaling", report, markdown(report), plot if final else None)
    if final and "plot" in report["notes"]:  # the reason the plot is missing, in the table too
        (out_dir / "scaling.md").write_text(markdown(report))


def _f(x, fmt=".3f") -> str:
    return "—" if x is None else format(x, fmt)


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
        "| V | TP | V/TP | kernel, 1 shard (ms) | ours on TP (ms) | collective (ms) | share of ours | collective / kernel | ours / kernel − 1 | target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for s in report["scaling"]:
        tgt = "—" if s["meets_target"] is None else ("yes" if s["meets_target"] else "**no**")
        lines.append(
            f"| {s['vocab']} | {s['tp']} | {s['v_local']} | {_f(s['kernel_single_shard_ms'])} | "
            f"{_f(s['ours_tp_ms'])} | {_f(s['collective_ms'], '.4f')} | {_fmt_pct(s['collective_share_of_total'])} | "
            f"{_fmt_pct(s['collective_over_kernel'])} | {_fmt_pct(s['tp_overhead_end_to_end'])} | {tgt} |")
    lines += ["", "## Forward / backward per implementation (max over ranks of the per-rank median)", "",
              "| V | TP | implementation | fwd (ms) | bwd (ms) | total (ms) | total / ours | max abs loss diff vs ours |",
              "|---:|---:|---|---:|---:|---:|---:|---:|"]
    ours = {(r["vocab"], r["tp"]): r["total_ms"] for r in report["results"] if r["impl"] == "ours"}
    for r in report["results"]:
        o = ours.get((r["vocab"], r["tp"]))
        rel = _f(r["total_ms"] / o, ".2f") if r["total_ms"] is not None and o else "—"
        name = r["impl"] + (" (1 shard, no TP)" if r["impl"] == "kernel" else "")
        if r["error"]:
            name += f" — failed: {r['error'][:80]}"
        lines.append(f"| {r['vocab']} | {r['tp']} | {name} | {_f(r['fwd_ms'])} | {_f(r['bwd_ms'])} | "
                     f"{_f(r['total_ms'])} | {rel} | {_f(r['max_abs_loss_diff_vs_ours'], '.2e')} |")
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {k}: {v}" for k, v in report["notes"].items()]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vocabs = report["meta"]["vocab"]
    fig, axes = plt.subplots(2, len(vocabs), figsize=(6 * len(vocabs), 8), squeeze=False)
    for j, v in enumerate(vocabs):
        ax = axes[0][j]
        rows = [r for r in report["results"] if r["vocab"] == v]
        for impl in dict.fromkeys(r["impl"] for r in rows):
            pts = [(r["tp"], r["total_ms"]) for r in rows if r["impl"] == impl and r["total_ms"] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", linestyle="--" if impl == "kernel" else "-",
                        label="ours, 1 shard (no TP)" if impl == "kernel" else impl)
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["meta"]["tp_sizes"], [str(t) for t in report["meta"]["tp_sizes"]])
        ax.set_yscale("log")
        ax.set_xlabel("TP")
        ax.set_ylabel("fwd + bwd per rank (ms)")
        ax.set_title(f"V = {v}, N = {report['meta']['tokens_per_rank']} per rank")
        ax.legend(fontsize=8)
        ax = axes[1][j]
        sc = [s for s in report["scaling"] if s["vocab"] == v and s["tp"] > 1]
        for key, label in (("collective_over_kernel", "collective / 1-shard kernel"),
                           ("collective_share_of_total", "collective share of ours"),
                           ("tp_overhead_end_to_end", "ours / kernel - 1")):
            pts = [(s["tp"], 100 * s[key]) for s in sc if s[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.axhline(100 * TARGET, color="red", linestyle=":", label="target 5 %")
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["meta"]["tp_sizes"], [str(t) for t in report["meta"]["tp_sizes"]])
        ax.set_xlabel("TP")
        ax.set_ylabel("%")
        ax.legend(fontsize=8)
    m = report["meta"]
    fig.suptitle(f"{m['device']} x {m['world_size']} ({m['backend']})" + (" — CPU smoke" if m["cpu_smoke"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
