"""Batch invariance, checked the same way on the CPU, the GPU and under TP: a fixed block of
tokens computed alone, then inside batches of other sizes, at other positions and under other
memory budgets (so that other strategies are chosen); the block's forward outputs must be the
same bits (``torch.equal``) every time.

``calls`` runs one op on one batch and returns the per-token outputs that the op's
``batch_invariant`` covers; ``budgets`` finds one memory budget per strategy the engine can
pick for a batch, from the engine's own choice (``strategy.choose_strategy``).
"""

from __future__ import annotations

import warnings

import torch

from vocab_parallel_loss import linear_cross_entropy, linear_token_logprobs, token_logprobs
from vocab_parallel_loss import backends
from vocab_parallel_loss.ops.fused_linear.strategy import choose_strategy

#: (rows before the block, rows after it): alone, then embedded at other positions in batches
#: of other sizes
LAYOUTS = ((0, 0), (3, 11), (29, 0))
OPS = ("token_logprobs", "linear_token_logprobs", "linear_cross_entropy")


def block_case(n, h, v, dtype, device, seed=0):
    """The fixed block: hidden states (``h`` columns; for ``token_logprobs`` its logits, ``h``
    = ``v``), targets (one ignored), per-token temperatures."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used
    e = (torch.randn(n, h, generator=g, device=device) * 0.7).to(dtype)
    t = torch.randint(0, v, (n,), generator=g, device=device)
    t[n // 2] = -100
    temp = torch.rand(n, generator=g, device=device) + 0.5
    return e, t, temp


def weights(h, v, dtype, device, seed=1):
    g = torch.Generator(device=device).manual_seed(seed)
    c = (torch.randn(v, h, generator=g, device=device) * h ** -0.5).to(dtype)
    b = (torch.randn(v, generator=g, device=device) * 0.1).to(dtype)
    return c, b


def embed(block, v: int, before: int, after: int, seed: int):
    """The block's rows with ``before`` and ``after`` other rows around them (other values)."""
    e, t, temp = block
    n = before + after
    if n == 0:
        return e, t, temp
    oe, ot, otemp = block_case(n, e.shape[1], v, e.dtype, e.device, seed)
    cat = lambda x, y: torch.cat([y[:before], x, y[before:]])  # noqa: E731
    return cat(e, oe), cat(t, ot), cat(temp, otemp)


def run(op, e, t, temp, c, b, impl="auto", budget=None, reduction="none", tp_group=None,
        invariant=True, cols=None):
    """The per-token outputs ``op`` guarantees under ``batch_invariant``, as a tuple; ``cols``:
    this rank's vocabulary columns under TP (of ``c`` and ``b``, or of the logits)."""
    if cols is not None:
        c, b = c[cols].contiguous(), b[cols].contiguous()
        if op == "token_logprobs":
            e = e[:, cols].contiguous()
    if op == "token_logprobs":  # ``e`` holds the logits (``c``, ``b`` unused)
        out = token_logprobs(e, t, temperature=temp, return_entropy=True, return_argmax=True,
                             tp_group=tp_group, batch_invariant=invariant)
        return out.log_probs, out.entropy, out.argmax
    leaves = [x.detach().clone().requires_grad_() for x in (e, c, b)]  # strategies need grads
    if op == "linear_token_logprobs":
        out = linear_token_logprobs(*leaves[:2], t, leaves[2], temperature=temp,
                                    return_entropy=True, return_argmax=True, impl=impl,
                                    memory_budget=budget, tp_group=tp_group,
                                    batch_invariant=invariant)
        return out.log_probs.detach(), out.entropy.detach(), out.argmax
    loss, lse = linear_cross_entropy(*leaves[:2], t, leaves[2], reduction=reduction,
                                     return_lse=True, label_smoothing=0.1, impl=impl,
                                     memory_budget=budget, tp_group=tp_group,
                                     batch_invariant=invariant)
    if reduction != "none":
        return (lse.detach(),)
    return loss.detach(), lse.detach()


def budgets(op, e, c, b, impl, reduction="none", tp_group=None, invariant=True):
    """``{strategy: budget}``: one memory budget per strategy the engine picks for this batch
    (``"saved"``, ``"partial"`` (the first columns saved), ``"grad_in_forward"``,
    ``"recompute"``), found by scanning budgets; ``{"any": None}`` where budgets choose nothing
    (the PyTorch backend, the op over logits)."""
    if op == "token_logprobs":
        return {"any": None}
    backend = backends.linear_backend(impl, e)
    if "saved" not in backend.STRATEGIES:
        return {"any": None}
    leaves = [x.detach().requires_grad_() for x in (e, c, b)]
    found = {}
    full = e.shape[0] * c.shape[0] * e.element_size() * 4 + (1 << 20)
    budget = 0.0
    while budget <= full:
        with warnings.catch_warnings():  # the scan passes budgets below the floor on purpose
            warnings.simplefilter("ignore", RuntimeWarning)
            st = choose_strategy(backend, leaves[0], leaves[1], leaves[2],
                                 reduction if op == "linear_cross_entropy" else "none", False,
                                 tp_group, None, 0.1 if op == "linear_cross_entropy" else 0.0,
                                 budget, invariant=invariant)
        name = "partial" if st.name == "saved" and st.size is not None else st.name
        found.setdefault(name, budget)
        budget = budget * 1.08 + 256
    return found


def check_block(op, block, c, b, layouts=LAYOUTS, impl="auto", reduction="none",
                tp_group=None, invariant=True, seed=10, cols=None):
    """Compute ``block`` alone, then embedded per ``layouts`` under every budget ``budgets``
    finds for that batch; assert the block's outputs equal. Returns the strategies seen."""
    e, t, temp = block
    n = e.shape[0]
    want = run(op, e, t, temp, c, b, impl, None, reduction, tp_group, invariant, cols)
    seen = set()
    for i, (before, after) in enumerate(layouts):
        be, bt, btemp = embed(block, c.shape[0], before, after, seed + i)
        local = (c, b) if cols is None else (c[cols], b[cols])
        for name, budget in budgets(op, be, *local, impl, reduction, tp_group,
                                    invariant).items():
            seen.add(name)
            got = run(op, be, bt, btemp, c, b, impl, budget, reduction, tp_group, invariant,
                      cols)
            for k, (w, g) in enumerate(zip(want, got)):
                g = g[before:before + n] if g.dim() else g
                assert torch.equal(w, g), (
                    f"{op} output {k} of the block differs with {before} rows before it, "
                    f"{after} after, strategy {name} (budget {budget}): max abs diff "
                    f"{(w.double() - g.double()).abs().max().item()}")
    return seen
