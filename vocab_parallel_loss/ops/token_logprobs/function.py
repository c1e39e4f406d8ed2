"""Autograd of the per-token log-probability and entropy (reinforcement-learning post-training).

Per token with raw logits ``z`` over the global vocabulary, the logits the policy samples from
are ``x = cap(scale * z) / T`` (temperature ``T``: a float or one per token). Outputs:
``log_prob = x_t - lse``, ``entropy = lse - sum_j p_j x_j`` and the argmax column. Every rank
(or column chunk) reduces its columns to five statistics (``kernels/logprobs.py``); one
all-gather over the TP group and ``formulas.merge_logprob_stats`` give the exact values on every
rank. Backward needs no communication for the logits path; the hidden-state path sums the
gradient of the hidden states over the group, like the fused linear loss.

Two entries: ``from_logits`` (this rank's logits shard, any strides) and ``from_hidden`` (hidden
states and this rank's classifier rows, in PyTorch: the logits exist one column chunk at a time;
the Triton kernels run the fused linear engine instead, ``linear_logprobs.py``).
"""

from __future__ import annotations

import torch

from ... import backends, communication
from ...formulas import logprob_and_entropy, merge_logprob_stats
from ...layout import RowView, like_rows, row_view
from ...reference import logprobs as torch_rows
from ...runtime import untraced
from ...autograd.first_order import refuse_double_backward
from ...autograd.main_grad import dummy as main_grad_dummy, home as main_grad_home
from . import contract
from .contract import LogprobOptions

#: Bytes of one fp32 column chunk of logits in the hidden-state path (its dz in the input dtype
#: is half of it again): 128 MiB keeps the GEMMs at 16384 x 2048 x H, full size on the H200.
CHUNK_BYTES = 128 * 1024 * 1024


def _gather(stats, o: LogprobOptions):
    """``(world, 5, N)`` statistics of every rank, and a device bool: the ranks' shard widths
    agree (``communication.check_shapes``: raised on a rank whose width is new to it)."""
    k, n = stats.shape
    if communication.world_size(o.group) == 1:
        return stats.unsqueeze(0), None
    send = stats.new_zeros(communication.stats_size(k, n))
    send[:k * n] = stats.reshape(-1)
    send[k * n] = o.width
    gathered = communication.gather_stats(send, o.group)
    communication.check_shapes(gathered, k, n, (o.width,), o.group)
    agree = communication.shapes_agree(communication.gathered_shapes(gathered, k, n), (o.width,))
    return communication.gathered_stats(gathered, k, n), agree


def finish(stats, t, o: LogprobOptions):
    """Merge over the TP group; apply ignore and out-of-range targets."""
    parts, agree = _gather(stats, o)
    m, s, w, x_t, col = merge_logprob_stats(parts)
    logp, ent, lse = logprob_and_entropy(m, s, w, x_t)
    if agree is not None:  # shards that disagree: NaN on every rank, without a host sync
        nan = torch.full((), float("nan"), dtype=lse.dtype, device=lse.device)
        logp, ent, lse = (torch.where(agree, x, nan) for x in (logp, ent, lse))
    ignored = t == o.ignore_index
    bad = ~ignored & ((t < 0) | (t >= o.vocab_size))
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp = torch.where(ignored, zero, torch.where(bad, torch.full_like(logp, float("nan")), logp))
    ent = torch.where(ignored, zero, ent)
    return logp, ent, lse, col.to(torch.int64), ignored, bad


def upstream_grad(g, n, like, ignored, bad=None):
    """A per-token upstream gradient: zeros when absent, 0 for ignored tokens, NaN for tokens
    with an out-of-range target whose log-prob is differentiated (their log-prob is NaN)."""
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
        de = communication.reduce_scatter_along_first_dim(de.view(full_shape), group)
    else:
        de = communication.all_reduce_sum(de, group)
    return de.to(e.dtype).view(e.shape)


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, t, inv_t, o: LogprobOptions):
        ctx.set_materialize_grads(False)
        view = row_view(logits)
        n = t.numel()
        f64 = logits.dtype == torch.float64
        stats = torch.empty((5, n), dtype=torch.float64 if f64 else torch.float32,
                            device=logits.device)
        if n:
            o.rows.stats(view, t, inv_t, o.col_start, o.valid, o.scale, o.softcap, stats)
        else:
            stats.zero_()
        logp, ent, lse, col, ignored, bad = finish(stats, t, o)
        ctx.save_for_backward(view.tensor, t, inv_t, lse, ent, ignored, bad)
        ctx.rows = (view.D1, view.s0, view.s1)
        ctx.o = o
        ctx.mark_non_differentiable(col)
        return logp, ent, col

    @staticmethod
    def backward(ctx, g_lp, g_ent, _):
        if torch.is_grad_enabled():  # create_graph=True
            refuse_double_backward("token_logprobs")
        logits, t, inv_t, lse, ent, ignored, bad = ctx.saved_tensors
        o = ctx.o
        if g_lp is None and g_ent is None:
            return None, None, None, None
        n = t.numel()
        g_lp = upstream_grad(g_lp, n, lse, ignored, bad)
        g_ent = upstream_grad(g_ent, n, lse, ignored)
        view = RowView(logits, *ctx.rows)
        dview = like_rows(view)
        o.rows.backward(view, dview, t, inv_t, lse, ent, g_lp, g_ent, o.col_start, o.valid,
                        o.scale, o.softcap)
        return dview.tensor, None, None, None


def from_logits(logits, t, inv_t, o: LogprobOptions):
    """``(log_probs, entropy, argmax)`` flat, from this rank's logits shard."""
    if o.rows.TRACEABLE:
        return _FromLogits.apply(logits, t, inv_t, o)
    return untraced(_FromLogits.apply, logits, t, inv_t, o)


def rows_backend(kernels: bool, dtype):
    """The row backend: the Triton kernels where they run (not for float64), else PyTorch."""
    if kernels and dtype != torch.float64 and backends.triton_logprobs is not None:
        return backends.triton_logprobs
    return torch_rows


def logprobs(logits, target, tp_group, temperature, ignore_index, return_entropy,
             return_argmax, vocab_range):
    """``functional.token_logprobs`` (see there): check, options, backend, then the Function."""
    contract.check(logits)
    t = contract.flat_targets(target, logits.shape[:-1], logits.device)
    o = contract.options(tp_group, logits.shape[-1], vocab_range, ignore_index, 1.0, None,
                         rows_backend(backends.triton_runs(logits), logits.dtype), logits.device)
    inv_t = contract.inverse_temperature(temperature, target, logits)
    lp, ent, col = from_logits(logits, t, inv_t, o)
    return contract.shaped(lp, ent, col, target.shape, return_entropy, return_argmax)


def _chunk_cols(n: int, v: int, elem: int) -> int:
    cols = max(256, (CHUNK_BYTES // max(1, n * elem)) // 256 * 256)
    return min(v, cols)


class _FromHidden(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, bias, t, inv_t, o: LogprobOptions, sequence_parallel: bool, main_grad: bool):
        gemm = torch_rows.TorchGemm
        ctx.set_materialize_grads(False)
        full = communication.gather_along_first_dim(e, o.group) if sequence_parallel else e
        e2 = full.reshape(-1, full.shape[-1])
        n, v = e2.shape[0], c.shape[0]
        f64 = e.dtype == torch.float64
        acc = torch.float64 if f64 else torch.float32
        step = _chunk_cols(n, v, 8 if f64 else 4)
        n_chunks = max(1, -(-v // step))
        parts = torch.zeros((n_chunks, 5, n), dtype=acc, device=e.device)
        parts[:, 0] = float("-inf")
        if n:
            z = torch.empty((n, min(step, v)), dtype=acc, device=e.device)
            for k, c0 in enumerate(range(0, v, step)):
                c1 = min(v, c0 + step)
                valid = max(0, min(c1, o.valid) - c0)
                if valid == 0:
                    break  # padding columns only from here on
                zk = z[:, :c1 - c0]
                gemm.logits(e2, c[c0:c1], None if bias is None else bias[c0:c1], zk)
                o.rows.stats(RowView(zk, n, 0, zk.stride(0)), t, inv_t, o.col_start + c0,
                             valid, o.scale, o.softcap, parts[k])
        local = torch.stack(merge_logprob_stats(parts)) if n_chunks > 1 else parts[0]
        logp, ent, lse, col, ignored, bad = finish(local, t, o)
        ctx.save_for_backward(e, c, bias, t, inv_t, lse, ent, ignored, bad)
        ctx.o, ctx.sp, ctx.step, ctx.main_grad = o, sequence_parallel, step, main_grad
        ctx.mark_non_differentiable(col)
        return logp, ent, col

    @staticmethod
    def backward(ctx, g_lp, g_ent, _):
        if torch.is_grad_enabled():  # create_graph=True
            refuse_double_backward("linear_token_logprobs")
        e, c, bias, t, inv_t, lse, ent, ignored, bad = ctx.saved_tensors
        o, gemm, step = ctx.o, torch_rows.TorchGemm, ctx.step
        need_e, need_c = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        full = communication.gather_along_first_dim(e, o.group) if ctx.sp else e
        e2 = full.reshape(-1, full.shape[-1])
        n, v = e2.shape[0], c.shape[0]
        acc = lse.dtype
        g_lp = upstream_grad(g_lp, n, lse, ignored, bad)
        g_ent = upstream_grad(g_ent, n, lse, ignored)
        de = torch.zeros((n, e2.shape[1]), dtype=acc, device=e.device) if need_e else None
        home = main_grad_home(c, ctx.main_grad, need_c)
        dc = torch.zeros_like(c) if need_c and home is None else None
        db = torch.zeros(v, dtype=acc, device=e.device) if need_b else None
        if n:
            z = torch.empty((n, min(step, v)), dtype=acc, device=e.device)
            dz = torch.empty((n, min(step, v)), dtype=e.dtype, device=e.device)
            for c0 in range(0, v, step):
                c1 = min(v, c0 + step)
                valid = max(0, min(c1, o.valid) - c0)
                if valid == 0:
                    break  # padding columns: zero gradient (dc, db start at zero)
                zk, dzk = z[:, :c1 - c0], dz[:, :c1 - c0]
                gemm.logits(e2, c[c0:c1], None if bias is None else bias[c0:c1], zk)
                o.rows.backward(RowView(zk, n, 0, zk.stride(0)),
                                RowView(dzk, n, 0, dzk.stride(0)), t, inv_t, lse, ent, g_lp,
                                g_ent, o.col_start + c0, valid, o.scale, o.softcap)
                if need_e:
                    gemm.acc(de, dzk, c[c0:c1])  # dE += dz @ C_chunk, fp32
                if need_c and home is not None:  # rounded once into main_grad
                    home[c0:c1].add_(dzk.t().to(acc) @ e2.to(acc))
                elif need_c:
                    gemm.store(dc[c0:c1], dzk.t(), e2)  # each dC row once, rounded once
                if need_b:
                    db[c0:c1] = dzk.sum(dim=0, dtype=acc)
        if home is not None:
            dc = main_grad_dummy(c)
        de_out = hidden_grad(de, full.shape, e, o.group, ctx.sp) if need_e else None
        return (de_out, dc, None if db is None else db.to(bias.dtype), None, None, None, None,
                None)


def from_hidden(e, c, bias, t, inv_t, o: LogprobOptions, sequence_parallel: bool,
                main_grad: bool = False):
    """``(log_probs, entropy, argmax)`` flat, from hidden states and this rank's rows, in
    PyTorch (the Triton path is ``linear_logprobs.py``); with ``main_grad`` the gradient of
    ``c`` is added into ``c.main_grad``."""
    return _FromHidden.apply(e, c, bias, t, inv_t, o, sequence_parallel, main_grad)
