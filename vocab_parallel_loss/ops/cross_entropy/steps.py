"""The forward and backward steps of the loss over logits, shared by the eager autograd
Function (``function.py``) and the ops registered for ``torch.compile``
(``compiled.py``).

Forward: per-shard statistics (backend kernel) -> one all-gather over the TP group (with each
shard's width, ``communication.check_shapes``) -> merge into the full-vocabulary loss and lse. Backward: no communication; the gradient is recomputed from the
saved lse and written once.
"""

from __future__ import annotations

import torch

from ... import communication
from ...backends import logits_backend
from ...formulas import compute_dtype
from ...layout import like_rows


def forward_impl(view, t, group, opts, memo=None):
    """Per-token fp32 loss ``(N,)`` and lse ``(2, N)`` of flat targets ``t`` from the
    ``RowView`` of the logits: the lse and its low part (``formulas.lse_low``), what backward
    needs for a softmax as precise as the loss near a large common offset."""
    logits = view.tensor
    n, device = t.numel(), logits.device
    dtype = compute_dtype(logits.dtype)  # fp32, or fp64 for float64 logits
    loss = torch.empty(n, dtype=dtype, device=device)
    if opts.vocab_size == logits.shape[-1]:  # one shard holds the whole vocabulary
        lse = torch.empty((2, n), dtype=dtype, device=device)
        if n > 0:
            logits_backend(logits).forward(view, t, opts, None, loss, lse, memo)
        return loss, lse
    # the stats (with this shard's width after them, written by the forward) and the lse in one
    # allocation: the lse is saved, the stats are gathered
    size = communication.stats_size(4, n)
    buf = torch.empty(size + 2 * n, dtype=dtype, device=device)
    send, lse = buf[:size], buf[size:].view(2, n)
    if n > 0:
        backend = logits_backend(logits)
        backend.forward(view, t, opts, send, None, None, memo)
        gathered = communication.gather_stats(send, group)
        communication.check_shapes(gathered, 4, n, (logits.shape[-1],), group)
        backend.merge(gathered, t, loss, lse, opts)
    return loss, lse


def backward_impl(view, t, lse, dloss, count, opts, inplace, memo=None):
    """The logits gradient: a new tensor, or written over ``view.tensor`` when ``inplace``."""
    if dloss.dim() > 1:
        dloss = dloss.reshape(-1)
    dview = view if inplace else like_rows(view)
    if t.numel() > 0:
        logits_backend(view.tensor).backward(view, dview, t, lse, dloss, count, opts, memo)
    if inplace:
        # the logits now hold their gradient: make any later use of them fail loudly
        torch.autograd.graph.increment_version(view.tensor)
    return dview.tensor
