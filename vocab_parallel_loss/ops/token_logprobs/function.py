"""Autograd of the per-token log-probability and entropy (reinforcement-learning post-training).

Per token with raw logits ``z`` over the global vocabulary, the logits the policy samples from
are ``x = cap(scale * z) / T`` (temperature ``T``: a float or one per token). Outputs:
``log_prob = x_t - lse``, ``entropy = lse - sum_j p_j x_j`` and the argmax column. Every rank
(or column chunk) reduces its columns to five statistics (``kernels/logprobs.py``); one
all-gather over the TP group and ``formulas.merge_logprob_stats`` give the exact values on every
rank. Backward needs no communication for the logits path; the hidden-state path sums the
gradient of the hidden states over the group, like the fused linear loss.

The Function here takes this rank's logits shard (any strides); from hidden states and this
rank's classifier rows, ``ops/linear_token_logprobs`` runs the fused linear engine and shares
``finish``, ``upstream_grad`` and ``hidden_grad``.
"""

from __future__ import annotations

import torch

from ... import backends, communication
from ...formulas import logprob_and_entropy, lse_low, merge_logprob_stats, out_of_range
from ...layout import RowView, like_rows, row_view
from ...reference import logprobs as torch_rows
from ...runtime import compiling, untraced
from ...autograd.first_order import refuse_double_backward
from ..fused_linear import compiled_checks
from . import contract
from .contract import LogprobOptions


def _gather(stats, o: LogprobOptions):
    """``(world, 5, N)`` statistics of every rank, a device bool: the ranks' shapes agree
    (``communication.shapes_agree``; raised on a rank whose shapes are new to it,
    ``check_shapes``), and the global vocabulary (a device int from the ranks' ranges)."""
    k, n = stats.shape
    if communication.world_size(o.group) == 1:
        return stats.unsqueeze(0), None, o.vocab_size
    send = stats.new_zeros(communication.stats_size(k, n))
    send[:k * n] = stats.reshape(-1)
    communication.put_shapes(send, k, n, o.shapes)
    gathered = communication.gather_stats(send, o.group)
    shapes = communication.gathered_shapes(gathered, k, n)
    if compiling():  # the host check as an op of the graph, run at run time
        agree = compiled_checks.shapes_agree(gathered, k, n, list(o.shapes),
                                             communication.group_key(o.group))
    else:
        communication.check_shapes(gathered, k, n, o.shapes, o.group)
        agree = communication.shapes_agree(shapes, o.shapes)
    return (communication.gathered_stats(gathered, k, n), agree,
            communication.gathered_vocab(shapes))


def finish(stats, t, o: LogprobOptions, bad_t=None):
    """Merge over the TP group; apply ignore, out-of-range targets and unusable temperatures
    (``bad_t``, ``contract.inverse_temperature``). Returns ``(log_prob, entropy, lse, argmax,
    ignored, bad, bad_ent, low)``: ``bad`` and ``bad_ent`` mark the tokens whose differentiated
    log-prob or entropy get a NaN gradient (``upstream_grad``), ``low`` is the lse's low part
    (``formulas.lse_low``)."""
    parts, agree, vocab = _gather(stats, o)
    # batch-invariant: the ranks' statistics summed in one order whatever the rows
    m, s, w, x_t, col = merge_logprob_stats(parts, ordered=o.invariant)
    logp, ent, lse = logprob_and_entropy(m, s, w, x_t)
    low = lse_low(m, s, lse)
    if agree is not None:  # shards that disagree: NaN on every rank, without a host sync
        nan = torch.full((), float("nan"), dtype=lse.dtype, device=lse.device)
        logp, ent, lse = (torch.where(agree, x, nan) for x in (logp, ent, lse))
    ignored = t == o.ignore_index
    bad = out_of_range(t, vocab, o.ignore_index)
    nan = torch.full((), float("nan"), dtype=logp.dtype, device=logp.device)
    bad_ent = None
    if bad_t is not None:  # no distribution at this temperature: NaN, whatever the target
        bad_ent = ~ignored & bad_t
        bad = bad | bad_ent
        ent = torch.where(bad_ent, nan, ent)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(ignored, zero, torch.where(bad, nan, logp))
    ent = torch.where(ignored, zero, ent)
    return logp, ent, lse, col.to(torch.int64), ignored, bad, bad_ent, low


def upstream_grad(g, n, like, ignored, bad=None):
    """A per-token upstream gradient: zeros when absent, 0 for ignored tokens, NaN for tokens
    whose output is NaN (``bad``: an out-of-range target's log-prob, an unusable temperature's
    outputs) where it is differentiated."""
    if g is None:
        return torch.zeros(n, dtype=like.dtype, device=like.device)
    g = g.reshape(-1).to(like.dtype)
    g = torch.where(ignored, torch.zeros_like(g), g)
    if bad is not None:
        g = torch.where(bad & (g != 0), torch.full_like(g, float("nan")), g)
    return g.contiguous()


def hidden_grad(de, full_shape, e, group, sequence_parallel: bool):
    """The hidden states' gradient from this rank's ``de`` over the gathered rows: summed over
    the TP group (with sequence parallelism reduce-scattered back to this rank's sequence
    shard), then rounded once to ``e``'s dtype and shape."""
    if sequence_parallel:
        de = communication.reduce_scatter_along_first_dim(de.view(full_shape), group, e.shape)
    else:
        de = communication.all_reduce_sum(de, group)
    return de.to(e.dtype).view(e.shape)


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, t, inv_t, bad_t, o: LogprobOptions):
        ctx.set_materialize_grads(False)
        view = row_view(logits)
        n = t.numel()
        f64 = logits.dtype == torch.float64
        stats = torch.empty((5, n), dtype=torch.float64 if f64 else torch.float32,
                            device=logits.device)
        if n:
            o.rows.stats(view, t, inv_t, o.col_start, o.valid, o.scale, o.softcap, stats,
                         invariant=o.invariant)
        else:
            stats.zero_()
        logp, ent, lse, col, ignored, bad, bad_ent, low = finish(stats, t, o, bad_t)
        # the lse with its low part: backward's softmax as precise as the forward near a large
        # common offset
        ctx.save_for_backward(view.tensor, t, inv_t, torch.stack([lse, low]), ent, ignored, bad,
                              bad_ent)
        ctx.rows = (view.D1, view.s0, view.s1)
        ctx.o = o
        ctx.mark_non_differentiable(col)
        return logp, ent, col

    @staticmethod
    def backward(ctx, g_lp, g_ent, _):
        if torch.is_grad_enabled():  # create_graph=True
            refuse_double_backward("token_logprobs")
        logits, t, inv_t, lse, ent, ignored, bad, bad_ent = ctx.saved_tensors
        o = ctx.o
        if g_lp is None and g_ent is None:
            return None, None, None, None, None
        n = t.numel()
        g_lp = upstream_grad(g_lp, n, ent, ignored, bad)
        g_ent = upstream_grad(g_ent, n, ent, ignored, bad_ent)
        view = RowView(logits, *ctx.rows)
        dview = like_rows(view)
        o.rows.backward(view, dview, t, inv_t, lse, ent, g_lp, g_ent, o.col_start, o.valid,
                        o.scale, o.softcap)
        return dview.tensor, None, None, None, None


def from_logits(logits, t, inv_t, bad_t, o: LogprobOptions):
    """``(log_probs, entropy, argmax)`` flat, from this rank's logits shard."""
    if o.rows.TRACEABLE:
        return _FromLogits.apply(logits, t, inv_t, bad_t, o)
    return untraced(_FromLogits.apply, logits, t, inv_t, bad_t, o)


def rows_backend(kernels: bool, dtype):
    """The row backend: the Triton kernels where they run (not for float64), else PyTorch."""
    if kernels and dtype != torch.float64 and backends.triton_logprobs is not None:
        return backends.triton_logprobs
    return torch_rows


def logprobs(logits, target, tp_group, temperature, ignore_index, return_entropy,
             return_argmax, vocab_range, batch_invariant=False):
    """``functional.token_logprobs`` (see there): check, options, backend, then the Function."""
    contract.check(logits, tp_group)
    t = contract.flat_targets(target, logits.shape[:-1], logits.device)
    o = contract.options(tp_group, logits.shape[-1], vocab_range, ignore_index, 1.0, None,
                         rows_backend(backends.triton_runs(logits), logits.dtype),
                         batch_invariant=batch_invariant)
    inv_t, bad_t = contract.inverse_temperature(temperature, target, logits)
    lp, ent, col = from_logits(logits, t, inv_t, bad_t, o)
    return contract.shaped(lp, ent, col, target.shape, return_entropy, return_argmax)
