"""The loss rows of ``bench_logprobs.py --fp32-head``: ``linear_cross_entropy`` with an fp32 LM
head, forward + backward, the mean and the per-token loss, beside PyTorch's cross entropy over
fp32 row chunks with TF32 off and on. Errors: the mean loss against fp64 over every token, the
per-token loss's largest absolute error on the first ``fp32_head.REF_ROWS`` tokens.
"""

from __future__ import annotations

from typing import Callable, List, Tuple

import torch

from . import env
from .fp32_head import (REF_ROWS, SMALL_BUDGET, allocated, matmul_tf32, measure_row,
                         row_chunks)
from .report import fmt, table

#: the markdown's and the report rows' ``pass`` of these rows
PASS = "loss fwd+bwd"
BASELINE = "torch fp32 rows, TF32 off"


def ours(precision: str, reduction: str, budget=None) -> Callable:
    def run(h, w, t):
        from vocab_parallel_loss import linear_cross_entropy

        return linear_cross_entropy(h, w, t, reduction=reduction, fp32_precision=precision,
                                    memory_budget=budget)
    return run


def torch_rows(tf32: bool, reduction: str, rows: int = 1024) -> Callable:
    """PyTorch's cross entropy of fp32 logits in row chunks, recomputed in backward per chunk."""
    def chunk(h, w, t):
        return torch.nn.functional.cross_entropy(h.float() @ w.t(), t, reduction="none")

    def run(h, w, t):
        with matmul_tf32(tf32):
            loss = torch.cat(row_chunks(chunk, h, w, t, rows))
        return loss.mean() if reduction == "mean" else loss
    return run


def implementations() -> List[Tuple[str, str, str, str, Callable]]:
    """``(name, hidden dtype, weight dtype, reduction, fn)``."""
    rows = []
    for red in ("mean", "none"):
        rows += [("ours, fp32_precision=fp32", "fp32", "fp32", red, ours("fp32", red)),
                 ("ours, bf16 hidden, fp32_precision=fp32", "bf16", "fp32", red,
                  ours("fp32", red)),
                 ("ours, fp32_precision=tf32", "fp32", "fp32", red, ours("tf32", red)),
                 ("ours, fp32_precision=fp32, 0.5 GiB", "fp32", "fp32", red,
                  ours("fp32", red, SMALL_BUDGET)),
                 (BASELINE, "fp32", "fp32", red, torch_rows(False, red)),
                 ("torch fp32 rows, TF32 on", "fp32", "fp32", red, torch_rows(True, red))]
    return rows


@torch.no_grad()  # the inputs require grad: a graph would keep the fp64 copies alive
def reference(h, w, t):
    """fp64 per-token losses of the first ``REF_ROWS`` tokens and the mean over all of them."""
    w64 = w.double()
    per = torch.cat([torch.nn.functional.cross_entropy(h[r0:r0 + REF_ROWS].double() @ w64.t(),
                                                       t[r0:r0 + REF_ROWS], reduction="none")
                     for r0 in range(0, h.shape[0], REF_ROWS)])
    return per[:REF_ROWS], per.mean()


def measure(dev, name, hd, wd, red, fn, inputs, refs, args) -> dict:
    row = {"impl": name, "hidden": hd, "weight": wd, "reduction": red, "pass": PASS}
    h, w, t, g_tok = inputs[(hd, wd)]

    def step():
        loss = fn(h, w, t)
        loss.backward(None if red == "mean" else g_tok)
        return loss

    def errors(loss):
        (per, mean), got = refs[hd], loss.detach().double()
        err = (got - mean).abs() if red == "mean" else (got[:per.shape[0]] - per).abs().max()
        return {"err_loss": err.item()}
    return measure_row(dev, row, h, w, step, errors, args)


def run_vocab(dev, v, args, h32, w32, t) -> List[dict]:
    """The loss rows at vocabulary ``v`` on ``fp32_head.run_vocab``'s inputs."""
    g_tok = torch.randn(t.shape[0], generator=torch.Generator().manual_seed(1)).to(t.device)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    inputs, refs, rows = {}, {}, []
    for name, hd, wd, red, fn in implementations():
        if (hd, wd) not in inputs:
            inputs[(hd, wd)] = (h32.to(dt[hd]).requires_grad_(), w32.to(dt[wd]).requires_grad_(),
                                t, g_tok)
        if hd not in refs:
            refs[hd] = reference(h32.to(dt[hd]), w32, t)
        env.log(f"V={v} loss {name} {red}")
        r = measure(dev, name, hd, wd, red, fn, inputs, refs, args)
        r["vocab"] = v
        rows.append(r)
        env.log(f"  {r}{allocated(dev)}")
    return rows


def markdown(rows: List[dict], v: int) -> List[str]:
    """The loss table of vocabulary ``v``: speed-ups on PyTorch fp32 of the same reduction."""
    rows = [r for r in rows if r["vocab"] == v and r["pass"] == PASS]
    base = {r["reduction"]: r["ms"] for r in rows if r["impl"] == BASELINE and "ms" in r}
    lines = [f"## V = {v}, loss (linear_cross_entropy), fwd+bwd", "",
             "Errors: the mean against fp64 over every token; the per-token loss's largest on "
             f"the first {REF_ROWS} tokens.", ""]
    lines += table(
        ["impl", "hidden", "weight", "reduction", "ms", "speed-up on torch fp32", "extra GiB",
         "err loss"],
        [[r["impl"], r["hidden"], r["weight"], r["reduction"], fmt(r.get("ms"), ".1f", "-"),
          fmt(base[r["reduction"]] / r["ms"] if r["reduction"] in base and "ms" in r else None,
              ".2f", "-"),
          fmt(r.get("extra_gib"), ".2f", "-"), fmt(r.get("err_loss"), ".1e", r.get("error", "-"))]
         for r in rows],
        "llllrrrr")
    return lines + [""]
