"""Per-token log-probs and entropy from hidden states (RL post-training), forward + backward of
both outputs under random upstream gradients, side by side with the peers in one process.

    python benchmarks/bench_logprobs.py [--n 16384] [--hidden 4096] [--vocab 151936 18992]
        [--verl-dir DIR] [--budgets 0.5 0.375]

Ours runs under its default memory budget (the ``ours`` row) and under each of ``--budgets``
(GiB): at N=16384, H=4096 0.5 GiB saves the first logits columns and recomputes the rest, 0.375
GiB recomputes all of them (the fp32 dE and one 128 MiB column chunk); 0 would narrow that chunk
to one tile, the least memory and the slowest.

Peers: verl's fused Triton kernel (``verl/utils/kernel`` loaded from ``--verl-dir``, an unpacked
verl wheel, without importing the rest of verl), Liger's fused linear scaled cross entropy
(its Hopper CuTe kernel when the CUTLASS DSL imports, else its chunked PyTorch fallback), a
TRL-style chunked PyTorch loop (row chunks under activation checkpointing) and plain PyTorch.
Reported per implementation: the median time, the peak memory above the inputs (less the
gradients it leaves), and the largest error of the log-probs, the entropy and dE against an
fp32 reference computed from fp32 logits of the same bf16 inputs.

``--smoke-cpu`` runs tiny shapes on the CPU (plumbing only; the Triton kernels need
TRITON_INTERPRET=1 there).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import traceback
import types
from pathlib import Path

import torch
import torch.utils.checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as common  # noqa: E402
from _common import Device  # noqa: E402

common.use_checkout_package()

from vocab_parallel_loss import linear_token_logprobs  # noqa: E402

GiB = 2**30
TEMPERATURE = 0.9


# ----------------------------------------------------------------------------------- peers
def ours(h, w, t, memory_budget=None):
    out = linear_token_logprobs(h, w, t, temperature=TEMPERATURE, return_entropy=True,
                                memory_budget=memory_budget)
    return out.log_probs, out.entropy


def ours_at(gib):
    """Ours under ``memory_budget`` = ``gib`` GiB (the default budget is the ``ours`` row)."""
    return f"ours @{gib:g} GiB", lambda h, w, t: ours(h, w, t, int(gib * GiB))


def torch_plain(h, w, t):
    x = (h @ w.t()).float() / TEMPERATURE
    ls = x.log_softmax(-1)
    return ls.gather(-1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)


def _chunk(h, w, t):
    return torch_plain(h, w, t)


def torch_chunked(h, w, t, rows=1024):
    """TRL-style: row chunks, each recomputed in backward (activation checkpointing)."""
    lps, ents = [], []
    for r0 in range(0, h.shape[0], rows):
        lp, ent = torch.utils.checkpoint.checkpoint(_chunk, h[r0:r0 + rows], w, t[r0:r0 + rows],
                                                    use_reentrant=False)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)


def load_verl(verl_dir):
    """verl's ``linear_cross_entropy`` from an unpacked wheel, with ``verl.utils.device``
    stubbed (the real one imports verl's platform plugins)."""
    root = Path(verl_dir) / "verl" / "utils" / "kernel"
    for name in ("verl", "verl.utils", "verl.utils.kernel"):
        sys.modules.setdefault(name, types.ModuleType(name)).__path__ = []
    sys.modules["verl.utils.kernel"].__path__ = [str(root)]
    device = types.ModuleType("verl.utils.device")
    device.get_device_capability = lambda: torch.cuda.get_device_capability()
    device.get_device_name = lambda: "cuda"
    device.is_cuda_available = torch.cuda.is_available()
    device.get_torch_device = lambda: torch.cuda
    sys.modules["verl.utils.device"] = device
    mods = {}
    for name in ("kernels", "linear_cross_entropy"):
        spec = importlib.util.spec_from_file_location(f"verl.utils.kernel.{name}", root / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mods[name]
        spec.loader.exec_module(mods[name])
    fn = mods["linear_cross_entropy"].linear_cross_entropy

    def verl(h, w, t):
        return fn(h, w, t, TEMPERATURE, "none", None)
    return verl


def load_liger():
    """Liger's fused linear scaled cross entropy: its Hopper CuTe kernel where the CUTLASS DSL
    imports, else its own chunked PyTorch fallback (what Liger itself runs then)."""
    from liger_kernel.ops import fused_linear_scaled_cross_entropy as lsce

    try:
        impl = lsce._resolve_implementation(torch.device("cuda"))
    except ImportError:
        impl = lsce._FusedLinearPPOFallbackFunction
    if impl is lsce._FusedLinearPPOFallbackFunction:
        def liger(h, w, t):
            nll, ent = impl.apply(h, w, t, TEMPERATURE, -100, True)
            return -nll, ent
        return "liger (its PyTorch fallback: no CUTLASS DSL)", liger

    def liger(h, w, t):
        nll, ent = impl.apply(h, w, t, TEMPERATURE, -100, 1, True)
        return -nll, ent
    return "liger", liger


# ----------------------------------------------------------------------------------- measure
def reference(h, w, t):
    hf, wf = h.detach().float().requires_grad_(), w.detach().float()
    lp, ent = torch_plain(hf, wf, t)
    return lp.detach(), ent.detach(), hf


def measure(dev, name, fn, h, w, t, g_lp, g_ent, ref, args):
    row = {"impl": name}
    try:
        def step():
            lp, ent = fn(h, w, t)
            torch.autograd.backward([lp, ent], [g_lp, g_ent])
            return lp, ent
        h.grad = w.grad = None
        base = dev.reset_peak()
        lp, ent = step()
        peak = dev.peak()
        grads = (h.grad.numel() * h.grad.element_size() + w.grad.numel() * w.grad.element_size())
        row["extra_gib"] = None if peak is None else (peak - base - grads) / GiB
        ref_lp, ref_ent, ref_de = ref
        row["err_logp"] = (lp.float() - ref_lp).abs().max().item()
        row["err_entropy"] = (ent.float() - ref_ent).abs().max().item()
        row["err_de_rel"] = ((h.grad.float() - ref_de).abs().max() / ref_de.abs().max()).item()
        del lp, ent

        def timed():
            h.grad = w.grad = None
            step()
        row["ms"] = dev.bench(timed, args.warmup, args.rep)
    except Exception as e:  # noqa: BLE001 - a failing peer is reported, not fatal
        row["error"] = f"{type(e).__name__}: {e}"
        common.log(traceback.format_exc(limit=3))
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
    ref_lp, ref_ent, hf = reference(h, w, t)
    lp, ent = torch_plain(hf, w.detach().float(), t)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    ref = (ref_lp, ref_ent, hf.grad.detach())
    del lp, ent, hf
    dev.empty_cache()
    rows = []
    for name, fn in impls:
        common.log(f"V={v} {name}")
        r = measure(dev, name, fn, h, w, t, g_lp, g_ent, ref, args)
        r["vocab"] = v
        rows.append(r)
        common.log(f"  {r}")
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
        lines += common.table(
            ["impl", "ms", "fastest peer / this", "extra GiB", "err log-p", "err entropy",
             "err dE (rel)"],
            [[r["impl"], common.fmt(r.get("ms"), ".2f", "-"),
              common.fmt(best / r["ms"] if best and "ms" in r else None, ".2f", "-"),
              common.fmt(r.get("extra_gib"), ".2f", "-"), common.fmt(r.get("err_logp"), ".1e", "-"),
              common.fmt(r.get("err_entropy"), ".1e", "-"),
              common.fmt(r.get("err_de_rel"), ".1e", r.get("error", "-"))] for r in rows],
            "lrrrrrr")
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
    ap.add_argument("--warmup", type=float, default=25)
    ap.add_argument("--rep", type=float, default=200)
    ap.add_argument("--out", default=str(common.RESULTS / "logprobs_h200"))
    ap.add_argument("--smoke-cpu", action="store_true")
    args = ap.parse_args()
    if args.smoke_cpu:
        args.n, args.hidden, args.vocab = 37, 16, [53]
    dev = Device("cpu" if args.smoke_cpu else "cuda")
    impls = [("ours", ours)] + [ours_at(g) for g in args.budgets]
    if args.verl_dir:
        try:
            impls.append(("verl", load_verl(args.verl_dir)))
        except Exception as e:  # noqa: BLE001
            common.log(f"verl not loaded: {type(e).__name__}: {e}")
    if not args.smoke_cpu:
        try:
            impls.append(load_liger())
        except Exception as e:  # noqa: BLE001
            common.log(f"liger not loaded: {type(e).__name__}: {e}")
    impls += [("torch chunked (TRL-style)", torch_chunked), ("torch", torch_plain)]
    impls = [(k, f) for k, f in impls if k not in args.skip]
    rows = []
    for v in args.vocab:
        rows += run_vocab(dev, v, args, impls)
    meta = dict(common.environment(dev), n=args.n, hidden=args.hidden, vocab=args.vocab)
    report = {"meta": meta, "rows": rows}
    for path in common.write_report(Path(args.out), report, markdown(report)):
        common.log(f"wrote {path}")


if __name__ == "__main__":
    main()
