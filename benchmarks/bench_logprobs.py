"""Per-token log-probs and entropy from hidden states (RL post-training), forward + backward of
both outputs under random upstream gradients, side by side with the peers in one process.

    python benchmarks/bench_logprobs.py [--n 16384] [--hidden 4096] [--vocab 151936 18992]
        [--verl-dir DIR] [--budgets 0.5 0.375]

Ours runs under its default memory budget (the ``ours`` row) and under each of ``--budgets``
(GiB), each also with ``batch_invariant=True`` (the ``..., batch-invariant`` rows, and below the
table their time over the default's at the same budget): at N=16384, H=4096 0.5 GiB saves the first logits columns and recomputes the rest, 0.375
GiB recomputes all of them (the fp32 dE and one 128 MiB column chunk); 0 would narrow that chunk
to one tile, the least memory and the slowest.

Peers: verl's fused Triton kernel (``verl/utils/kernel`` loaded from ``--verl-dir``, an unpacked
verl wheel, without importing the rest of verl), Liger's fused linear scaled cross entropy
(its Hopper CuTe kernel when the CUTLASS DSL imports, else its chunked PyTorch fallback), a
TRL-style chunked PyTorch loop (row chunks under activation checkpointing) and plain PyTorch.
Reported per implementation: the median time, the peak memory above the inputs (less the
gradients it leaves), and the largest error of the log-probs, the entropy and dE against an
fp32 reference computed from fp32 logits of the same bf16 inputs.

``--fp32-head`` measures the fp32-head table instead (``harness/fp32_head.py``): fp32 weights
with fp32 or bf16 hidden states, ours at each ``fp32_precision`` beside PyTorch in fp32 with
TF32 off and on and verl fed fp32 inputs, forward only and forward + backward; and the fp32-head
loss (``harness/fp32_head_loss.py``: ``linear_cross_entropy``, mean and per token, beside
PyTorch's cross entropy in fp32), forward + backward.

``--smoke-cpu`` runs tiny shapes on the CPU (plumbing only; the Triton kernels need
TRITON_INTERPRET=1 there).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import env, fp32_head, fp32_head_loss  # noqa: E402
from harness.errors import logprobs_reference, max_abs_diff, rel_max_diff  # noqa: E402
from harness.peers.logprobs import (  # noqa: E402
    GiB, INVARIANT, TEMPERATURE, load_liger, load_verl, ours, ours_at, ours_invariant,
    torch_chunked, torch_plain)
from harness.report import fmt, table, write_report  # noqa: E402
from harness.timing import Device  # noqa: E402

env.use_checkout_package()


# ----------------------------------------------------------------------------------- measure
def measure(dev, name, fn, h, w, t, g_lp, g_ent, ref, args):
    row = {"impl": name}
    try:
        def step():
            lp, ent = fn(h, w, t)
            torch.autograd.backward([lp, ent], [g_lp, g_ent])
            return lp, ent
        h.grad = w.grad = None
        (lp, ent), peak = dev.peak_during(step)
        grads = (h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size())
        row["extra_gib"] = None if peak is None else (peak - grads) / GiB
        ref_lp, ref_ent, ref_de = ref
        row["err_logp"] = max_abs_diff(lp, ref_lp)
        row["err_entropy"] = max_abs_diff(ent, ref_ent)
        row["err_de_rel"] = rel_max_diff(h.grad, ref_de)
        del lp, ent

        def timed():
            h.grad = w.grad = None
            step()
        row["ms"] = dev.bench(timed, args.warmup, args.rep)
    except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
        row["error"] = f"{type(e).__name__}: {e}"
        env.log(traceback.format_exc(limit=3))
    dev.empty_cache()
    return row


def run_vocab(dev, v, args, impls):
    n, hdim = args.n, args.hidden
    dtype = torch.float32 if args.smoke_cpu else torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(n, hdim, generator=g) * 0.5).to(dtype).to(dev.torch).requires_grad_()
    w = (torch.randn(v, hdim, generator=g) * hdim ** -0.5).to(dtype).to(dev.torch).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(dev.torch)
    g_lp = torch.randn(n, generator=g).to(dev.torch)
    g_ent = torch.randn(n, generator=g).to(dev.torch)
    ref = logprobs_reference(torch_plain, h, w, t, g_lp, g_ent)
    dev.empty_cache()
    rows = []
    for name, fn in impls:
        env.log(f"V={v} {name}")
        r = measure(dev, name, fn, h, w, t, g_lp, g_ent, ref, args)
        r["vocab"] = v
        rows.append(r)
        env.log(f"  {r}")
    return rows


def markdown(report):
    m = report["meta"]
    lines = [f"# Token log-probs and entropy from hidden states, {m['device']}", "",
             f"N={m['n']}, H={m['hidden']}, bf16, temperature {TEMPERATURE}, forward + backward "
             f"of both outputs; torch {m['torch']}, triton {m['triton']}; commit {m['commit']}.",
             "Memory: peak above the inputs, less the gradients left behind. Errors: largest "
             "absolute error of log-prob and entropy, and of dE relative to its largest entry, "
             "against fp32 logits of the same inputs.", ""]
    for v in m["vocab"]:
        rows = [r for r in report["rows"] if r["vocab"] == v]
        ok = [r["ms"] for r in rows if "ms" in r and not r["impl"].startswith("ours")]
        best = min(ok) if ok else None
        lines += [f"## V = {v}", ""]
        lines += table(
            ["impl", "ms", "fastest peer / this", "extra GiB", "err log-p", "err entropy",
             "err dE (rel)"],
            [[r["impl"], fmt(r.get("ms"), ".2f", "-"),
              fmt(best / r["ms"] if best and "ms" in r else None, ".2f", "-"),
              fmt(r.get("extra_gib"), ".2f", "-"), fmt(r.get("err_logp"), ".1e", "-"),
              fmt(r.get("err_entropy"), ".1e", "-"),
              fmt(r.get("err_de_rel"), ".1e", r.get("error", "-"))] for r in rows],
            "lrrrrrr")
        lines.append("")
        ms = {r["impl"]: r["ms"] for r in rows if "ms" in r}
        for name in [r["impl"] for r in rows if INVARIANT.format(r["impl"]) in ms]:
            if name in ms:
                lines.append(f"- `batch_invariant=True`, {name}: "
                             f"{ms[INVARIANT.format(name)] / ms[name]:.3f}x the default's time")
        lines.append("")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, nargs="+", default=[151936, 18992])
    ap.add_argument("--verl-dir", default=None, help="an unpacked verl wheel (skip verl if unset)")
    ap.add_argument("--budgets", type=float, nargs="*", default=[0.5, 0.375],
                    help="rows of ours under these memory budgets (GiB)")
    ap.add_argument("--skip", nargs="*", default=[], help="implementations to leave out")
    ap.add_argument("--no-invariant", action="store_true",
                    help="leave out the batch_invariant=True rows")
    ap.add_argument("--warmup", type=float, default=25)
    ap.add_argument("--rep", type=float, default=200)
    ap.add_argument("--out", default=str(env.RESULTS / "logprobs_h200"))
    ap.add_argument("--smoke-cpu", action="store_true")
    ap.add_argument("--fp32-head", action="store_true",
                    help="the fp32-head table (harness/fp32_head.py) instead")
    ap.add_argument("--fp32-head-tables", nargs="+", choices=("logprobs", "loss"),
                    default=["logprobs", "loss"], help="which fp32-head tables to measure")
    args = ap.parse_args()
    if args.smoke_cpu:
        args.n, args.hidden, args.vocab = 37, 16, [53]
    dev = Device("cpu" if args.smoke_cpu else "cuda")
    if args.fp32_head:
        return run_fp32_head(dev, args)
    impls = [("ours", ours)] + [ours_at(g) for g in args.budgets]
    if not args.no_invariant:
        impls += [ours_invariant()] + [ours_invariant(g) for g in args.budgets]
    if args.verl_dir:
        try:
            impls.append(("verl", load_verl(args.verl_dir)))
        except Exception as e:  # noqa: BLE001
            env.log(f"verl not loaded: {type(e).__name__}: {e}")
    if not args.smoke_cpu:
        try:
            impls.append(load_liger())
        except Exception as e:  # noqa: BLE001
            env.log(f"liger not loaded: {type(e).__name__}: {e}")
    impls += [("torch chunked (TRL-style)", torch_chunked), ("torch", torch_plain)]
    impls = [(k, f) for k, f in impls if k not in args.skip]
    rows = []
    for v in args.vocab:
        rows += run_vocab(dev, v, args, impls)
    meta = dict(env.environment(dev), n=args.n, hidden=args.hidden, vocab=args.vocab)
    report = {"meta": meta, "rows": rows}
    for path in write_report(Path(args.out), report, markdown(report)):
        env.log(f"wrote {path}")


def run_fp32_head(dev, args):
    verl = None
    if args.verl_dir:
        try:
            verl = load_verl(args.verl_dir)
        except Exception as e:  # noqa: BLE001
            env.log(f"verl not loaded: {type(e).__name__}: {e}")
    rows = []
    for v in args.vocab:
        if "logprobs" in args.fp32_head_tables:
            rows += fp32_head.run_vocab(dev, v, args, verl)
        if "loss" in args.fp32_head_tables:
            rows += fp32_head_loss.run_vocab(dev, v, args,
                                             *fp32_head.make_inputs(dev, v, args)[:3])
    meta = dict(env.environment(dev), n=args.n, hidden=args.hidden, vocab=args.vocab)
    report = {"meta": meta, "rows": rows}
    text = "\n".join([fp32_head.markdown(report)]
                     + [line for v in args.vocab for line in fp32_head_loss.markdown(rows, v)])
    out = Path(args.out)
    for path in write_report(out.with_name(out.name + "_fp32_head"), report, text):
        env.log(f"wrote {path}")


if __name__ == "__main__":
    main()
