"""The fp32-head rows of ``bench_logprobs.py --fp32-head``: token log-probs and entropy where
the LM head's weight is fp32 (what RL trainers run against the training-inference mismatch),
forward only and forward + backward of both outputs.

Rows: ours with fp32 and with bf16 hidden states at each ``fp32_precision``, under the default
memory budget and a stated 0.5 GiB, and with ``batch_invariant=True``; PyTorch row chunks
in fp32 with TF32 off and on; verl's fused kernel fed fp32 inputs (``--verl-dir``); ours on bf16
weights for scale. Errors are the largest absolute errors of the log-probs and the entropy
against fp64 on the first ``REF_ROWS`` tokens of the hidden states as given.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Callable, List, Tuple

import torch

from . import env
from .peers.logprobs import GiB, TEMPERATURE
from .report import fmt, table

#: tokens whose log-probs and entropy are checked against fp64
REF_ROWS = 512


#: the stated memory budget of the ``..., 0.5 GiB`` rows
SMALL_BUDGET = 0.5 * 2**30


def ours(precision: str, budget=None, invariant: bool = False) -> Callable:
    def run(h, w, t):
        from vocab_parallel_loss import linear_token_logprobs

        out = linear_token_logprobs(h, w, t, temperature=TEMPERATURE, return_entropy=True,
                                    fp32_precision=precision, memory_budget=budget,
                                    batch_invariant=invariant)
        return out.log_probs, out.entropy
    return run


def torch_rows(tf32: bool, rows: int = 1024) -> Callable:
    """fp32 PyTorch in row chunks (TF32 off: what an fp32 head computes in PyTorch; on: the
    speed PyTorch trades its accuracy for), recomputed in backward per chunk."""
    def chunk(h, w, t):
        x = (h.float() @ w.t()) / TEMPERATURE
        ls = x.log_softmax(-1)
        return ls.gather(-1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)

    def run(h, w, t):
        with matmul_tf32(tf32):
            lps, ents = zip(*row_chunks(chunk, h, w, t, rows))
            return torch.cat(lps), torch.cat(ents)
    return run


@contextlib.contextmanager
def matmul_tf32(on: bool):
    """PyTorch's CUDA matmuls in TF32 (``on``) or IEEE fp32 within the block."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def row_chunks(chunk: Callable, h, w, t, rows: int) -> list:
    """``chunk(h, w, t)`` of each ``rows`` rows, recomputed in backward (checkpointed) when
    gradients are on."""
    outs = []
    for r0 in range(0, h.shape[0], rows):
        sl = slice(r0, r0 + rows)
        if torch.is_grad_enabled():
            outs.append(torch.utils.checkpoint.checkpoint(chunk, h[sl], w, t[sl],
                                                          use_reentrant=False))
        else:
            outs.append(chunk(h[sl], w, t[sl]))
    return outs


def implementations(verl=None) -> List[Tuple[str, str, str, Callable]]:
    """``(name, hidden dtype, weight dtype, fn)``."""
    rows = [("ours, fp32_precision=fp32", "fp32", "fp32", ours("fp32")),
            ("ours, fp32_precision=tf32", "fp32", "fp32", ours("tf32")),
            ("ours, bf16 hidden, fp32_precision=fp32", "bf16", "fp32", ours("fp32")),
            ("ours, bf16 hidden, fp32_precision=tf32", "bf16", "fp32", ours("tf32")),
            ("ours, fp32_precision=fp32, 0.5 GiB", "fp32", "fp32", ours("fp32", SMALL_BUDGET)),
            ("ours, bf16 hidden, fp32_precision=fp32, 0.5 GiB", "bf16", "fp32",
             ours("fp32", SMALL_BUDGET)),
            ("ours, fp32_precision=fp32, batch-invariant", "fp32", "fp32",
             ours("fp32", invariant=True)),
            ("ours, bf16 hidden, fp32_precision=fp32, batch-invariant", "bf16", "fp32",
             ours("fp32", invariant=True)),
            ("torch fp32 rows, TF32 off", "fp32", "fp32", torch_rows(False)),
            ("torch fp32 rows, TF32 on", "fp32", "fp32", torch_rows(True))]
    if verl is not None:
        rows.append(("verl, fp32 inputs", "fp32", "fp32", verl))
    rows.append(("ours, bf16 weight (scale)", "bf16", "bf16", ours("fp32")))
    return rows


@torch.no_grad()  # the inputs require grad: a graph would keep the fp64 copies alive
def reference(h, w, t):
    """fp64 log-probs and entropy of the first ``REF_ROWS`` tokens."""
    z = (h[:REF_ROWS].double() @ w.double().t()) / TEMPERATURE
    ls = z.log_softmax(-1)
    return ls.gather(-1, t[:REF_ROWS, None])[:, 0], -(ls.exp() * ls).sum(-1)


def measure(dev, name, hd, wd, fn, inputs, refs, backward: bool, args) -> dict:
    row = {"impl": name, "hidden": hd, "weight": wd, "pass": "fwd+bwd" if backward else "fwd"}
    h, w, t, g_lp, g_ent = inputs[(hd, wd)]

    def step():
        with torch.set_grad_enabled(backward):
            lp, ent = fn(h, w, t)
            if backward:
                torch.autograd.backward([lp, ent], [g_lp, g_ent])
        return lp, ent

    def errors(out):
        (lp, ent), (ref_lp, ref_ent) = out, refs[hd]
        n = ref_lp.shape[0]
        return {"err_logp": (lp[:n].double() - ref_lp).abs().max().item(),
                "err_entropy": (ent[:n].double() - ref_ent).abs().max().item()}
    return measure_row(dev, row, h, w, step, errors, args)


def measure_row(dev, row: dict, h, w, step: Callable, errors: Callable, args) -> dict:
    """``row`` with the extra memory of one ``step()`` (peak less the gradients of ``h`` and
    ``w`` it leaves), ``errors(step's output)`` and the median time of ``step``; a failing row
    gets its error instead, not raised."""
    try:
        h.grad = w.grad = None
        out, peak = dev.peak_during(step)
        grads = sum(x.grad.numel() * x.grad.element_size() for x in (h, w) if x.grad is not None)
        row["extra_gib"] = None if peak is None else (peak - grads) / GiB
        row.update(errors(out))
        del out

        def timed():
            h.grad = w.grad = None
            step()
        row["ms"] = dev.bench(timed, args.warmup, args.rep)
    except Exception as e:  # noqa: BLE001 - a failing row is reported, not fatal
        row["error"] = f"{type(e).__name__}: {e}"[:200]
        env.log(traceback.format_exc(limit=3))
    h.grad = w.grad = None
    dev.empty_cache()
    return row


def allocated(dev) -> str:
    """What the process holds on the GPU now (after a row: nothing of the row should stay)."""
    return f", {torch.cuda.memory_allocated(dev.torch) / GiB:.2f} GiB held" if dev.cuda else ""


def make_inputs(dev, v: int, args):
    """fp32 hidden states and weight, targets and the two outputs' upstream gradients."""
    n, hdim = args.n, args.hidden
    g = torch.Generator(device="cpu").manual_seed(0)
    h32 = (torch.randn(n, hdim, generator=g) * 0.5).to(dev.torch)
    w32 = (torch.randn(v, hdim, generator=g) * hdim ** -0.5).to(dev.torch)
    t = torch.randint(0, v, (n,), generator=g).to(dev.torch)
    g_lp = torch.randn(n, generator=g).to(dev.torch)
    g_ent = torch.randn(n, generator=g).to(dev.torch)
    return h32, w32, t, g_lp, g_ent


def run_vocab(dev, v, args, verl=None) -> List[dict]:
    h32, w32, t, g_lp, g_ent = make_inputs(dev, v, args)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    inputs, refs = {}, {}
    rows = []
    for pass_backward in (False, True):
        for name, hd, wd, fn in implementations(verl):
            if (hd, wd) not in inputs:
                inputs[(hd, wd)] = (h32.to(dt[hd]).requires_grad_(), w32.to(dt[wd]).requires_grad_(),
                                    t, g_lp, g_ent)
            if hd not in refs:
                refs[hd] = reference(h32.to(dt[hd]), w32, t)
            env.log(f"V={v} {name} {'fwd+bwd' if pass_backward else 'fwd'}")
            r = measure(dev, name, hd, wd, fn, inputs, refs, pass_backward, args)
            r["vocab"] = v
            rows.append(r)
            env.log(f"  {r}{allocated(dev)}")
    return rows


def markdown(report) -> str:
    m = report["meta"]
    if any(r["pass"] in ("fwd", "fwd+bwd") for r in report["rows"]):
        title = "Token log-probs and entropy"
        scope = (f", temperature {TEMPERATURE}; forward only (no grad) and forward + backward of "
                 "both outputs; ")
        errors = (f" Errors: largest absolute error of log-prob and entropy on the first "
                  f"{REF_ROWS} tokens against fp64 of the same inputs (the bf16 weight row: of "
                  "its own bf16 weight).")
    else:  # the loss table alone: its own section says how its errors are taken
        title, scope, errors = "The loss", "; ", ""
    lines = [f"# {title} with an fp32 LM head, {m['device']}", "",
             f"N={m['n']}, H={m['hidden']}{scope}torch {m['torch']}, triton {m['triton']}; "
             f"commit {m['commit']}.",
             "Memory: peak above the inputs, less the gradients left behind." + errors, ""]
    for v in m["vocab"]:
        for p in ("fwd", "fwd+bwd"):
            rows = [r for r in report["rows"] if r["vocab"] == v and r["pass"] == p]
            if not rows:  # the loss table alone
                continue
            base = next((r["ms"] for r in rows if r["impl"] == "torch fp32 rows, TF32 off"
                         and "ms" in r), None)
            lines += [f"## V = {v}, {p}", ""]
            lines += table(
                ["impl", "hidden", "weight", "ms", "speed-up on torch fp32", "extra GiB",
                 "err log-p", "err entropy"],
                [[r["impl"], r["hidden"], r["weight"], fmt(r.get("ms"), ".1f", "-"),
                  fmt(base / r["ms"] if base and "ms" in r else None, ".2f", "-"),
                  fmt(r.get("extra_gib"), ".2f", "-"), fmt(r.get("err_logp"), ".1e", "-"),
                  fmt(r.get("err_entropy"), ".1e", r.get("error", "-"))] for r in rows],
                "lllrrrrr")
            lines.append("")
    return "\n".join(lines)
