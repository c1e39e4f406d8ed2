"""Fused linear cross entropy, vocab-parallel: the loss from hidden states and this rank's
classifier rows, without materializing the ``(N, V_local)`` logits.

Forward (per rank): one fused pass gives per-row statistics of the local logits (max, sum of
exponentials, target logit, sum of logits); one all-gather of those ``4 x N`` floats over the TP
group and a merge give the full-vocabulary lse and loss on every rank. Saved for backward: the
inputs, the flat targets and the lse (O(N)).

Backward: recompute the logits chunk by chunk, form ``dlogits`` from the saved lse, and
accumulate ``dE`` and ``dC`` in fp32. ``dC`` is local. ``dE`` is summed over the TP group in
fp32 (all-reduce; with ``sequence_parallel`` a reduce-scatter back to the sequence shard) and
rounded once to the input dtype.

Math (``formulas.py``; docs/design.md), per token with global logits ``x``, target ``t``, smoothing ``a``,
z-loss ``z``, global vocabulary ``V``::

    loss = (1-a) (lse - x_t) + a (lse - sum_j x_j / V) + z lse^2
    dx_j = g (softmax_j (1 + 2 z lse) - (1-a) [j == t] - a / V)

with the softcap chain rule ``dz = dx (1 - tanh^2)`` when ``x = softcap tanh(z / softcap)``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .. import communication
from ..formulas import merge_stats, relative_sums, token_loss
from ..reference.linear import TorchBackend


@dataclasses.dataclass(frozen=True)
class _Opts:
    ignore_index: int
    softcap: Optional[float]
    reduction: str
    shift: int
    group: object
    sequence_parallel: bool
    smoothing: float
    z_loss: float
    backend: object
    grad_in_forward: bool = False


def _rows(e: torch.Tensor, targets: torch.Tensor, o: _Opts):
    """Gather (sequence parallel), shift and flatten: ``(N, H)`` rows and ``(N,)`` targets."""
    if o.sequence_parallel:
        e = communication.gather_along_first_dim(e, o.group)
    full_shape = e.shape
    if o.shift:
        e = e[..., :-o.shift, :] if e.shape[-2] > o.shift else e[..., :0, :]
        targets = targets[..., o.shift:]
    return e.reshape(-1, e.shape[-1]), targets.reshape(-1), full_shape, e.shape


def _merge(stats: torch.Tensor, v_local: int, o: "_Opts"):
    """All-gather ``(4, N)`` local statistics of ``v_local`` columns (the backends' format: the
    last row is the sum of logits); returns ``(m, s, x_t, sum (x - m))`` of the global row."""
    if o.smoothing > 0:
        relative_sums(stats, v_local)
    return merge_stats(communication.gather_stats(stats, o.group), v_local)


def _coef(lse, g, o: _Opts, v_global: int, grad_lse=None):
    """Per-row coefficients ``(4, N)``: lse, softmax weight, one-hot weight, constant (in the
    lse's dtype: fp32, or fp64 for float64 inputs)."""
    a, z = o.smoothing, o.z_loss
    gp = g * (1.0 + 2.0 * z * lse) if z > 0 else g
    if grad_lse is not None:
        gp = gp + grad_lse
    return torch.stack([lse, gp, g * (1.0 - a), g * (a / v_global)])


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, bias, targets, o: _Opts):
        ctx.set_materialize_grads(False)
        world, rank = communication.world_size(o.group), communication.rank(o.group)
        v_local = c.shape[0]
        v_global = v_local * world
        v_offset = rank * v_local
        e2, t2, full_shape, shifted_shape = _rows(e, targets, o)
        grads = (None, None, None)
        if o.grad_in_forward:
            row_stats, grads = _forward_with_grads(ctx, e2, c, bias, t2, o, v_global, v_offset)
        else:
            stats = o.backend.forward_stats(e2, c, bias, t2, v_offset, o.softcap,
                                            o.smoothing > 0)
            row_stats = _merge(stats, v_local, o)
        loss, lse, ignored, _ = token_loss(t2, *row_stats, v_global, o.ignore_index,
                                           o.smoothing, o.z_loss)

        count = (~ignored).sum() if o.reduction == "mean" else None
        ctx.save_for_backward(e, c, bias, targets, lse, count, *grads)
        ctx.o = o
        ctx.meta = (v_global, v_offset, full_shape, shifted_shape)

        lse_out = lse.view(shifted_shape[:-1])
        if o.reduction == "none":
            out = loss.view(shifted_shape[:-1])
        elif o.reduction == "sum":
            out = loss.sum()
        else:
            out = loss.sum() / count.clamp(min=1)
        return out, lse_out

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        e, c, bias, targets, lse, count, de_f, dc_f, db_f = ctx.saved_tensors
        o: _Opts = ctx.o
        v_global, v_offset, full_shape, shifted_shape = ctx.meta
        need_de, need_dc, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], (
            bias is not None and ctx.needs_input_grad[2])
        if grad_loss is None and grad_lse is None:
            return None, None, None, None, None
        dev = e.device
        de32 = dc = db = None
        e2 = t2 = None
        if o.grad_in_forward:
            # gradients of the loss were formed in forward with an upstream gradient of 1
            gl = (grad_loss.float() if grad_loss is not None
                  else torch.zeros((), dtype=torch.float32, device=dev))
            if need_de:
                de32 = de_f * gl
            if need_dc:
                dc = torch.empty_like(c, memory_format=torch.contiguous_format)
                torch.mul(dc_f, gl, out=dc) if grad_lse is None else dc.copy_(dc_f * gl)
            if need_db:
                db = db_f * gl
            if grad_lse is not None:  # the lse output's gradient: the usual recompute pass
                e2, t2, _, _ = _rows(e, targets, o)
                coef = _coef(lse, torch.zeros_like(lse), o, v_global, grad_lse.reshape(-1).float())
                x_de, x_dc, x_db = o.backend.backward(e2, c, bias, t2, v_offset, coef, o.softcap,
                                                      need_de, need_dc, need_db)
                if need_de:
                    de32 = de32 + x_de
                if need_dc:
                    dc = (dc_f * gl + x_dc.float()).to(c.dtype)
                if need_db:
                    db = db + x_db
        else:
            e2, t2, _, _ = _rows(e, targets, o)
            coef = _coef(lse, _token_grad(grad_loss, t2, count, o, lse.dtype), o, v_global,
                         grad_lse.reshape(-1).to(lse.dtype) if grad_lse is not None else None)
            de32, dc, db = o.backend.backward(e2, c, bias, t2, v_offset, coef, o.softcap,
                                              need_de, need_dc, need_db)
        de = None
        if need_de:
            if not o.sequence_parallel:  # else the reduce-scatter below does the sum
                de32 = communication.all_reduce_sum(de32, o.group)
            if o.shift and not o.sequence_parallel:
                # round straight into the input-dtype gradient: no fp32 copy of the full shape
                de = _unshifted(de32, full_shape, shifted_shape, e.dtype)
            else:
                # the reduce-scatter splits the full sequence: pad it in fp32 first
                de32 = (_unshifted(de32, full_shape, shifted_shape, de32.dtype) if o.shift
                        else de32.view(full_shape))
                if o.sequence_parallel:
                    de32 = communication.reduce_scatter_along_first_dim(de32, o.group)
                de = de32.to(e.dtype)
        if db is not None:
            db = db.to(bias.dtype)
        return de, dc, db, None, None


def _unshifted(de32, full_shape, shifted_shape, dtype):
    """The gradient of the shifted positions placed into the full sequence (0 for the last
    position, which ``shift`` drops), in ``dtype``."""
    full = torch.zeros(tuple(full_shape), dtype=dtype, device=de32.device)
    full[..., :shifted_shape[-2], :] = de32.view(shifted_shape)
    return full


def _token_grad(grad_loss, t2, count, o: _Opts, dtype):
    """Per-token upstream gradient of the loss in ``dtype`` (0 for ignored tokens)."""
    n, dev = t2.numel(), t2.device
    valid = t2 != o.ignore_index
    if grad_loss is None:
        g = torch.zeros(n, dtype=dtype, device=dev)
    elif o.reduction == "none":
        g = grad_loss.reshape(-1).to(dtype)
    elif o.reduction == "sum":
        g = grad_loss.to(dtype).expand(n)
    else:
        g = (grad_loss.to(dtype) / count.clamp(min=1)).expand(n)
    return torch.where(valid, g, torch.zeros((), dtype=dtype, device=dev))


def _forward_with_grads(ctx, e2, c, bias, t2, o: _Opts, v_global: int, v_offset: int):
    """Scalar loss: statistics and both gradients (for an upstream gradient of 1) in one pass
    over materialized fp32 row chunks of the logits (Triton backend only; see
    ``LCEConfig.grad_in_forward``). Returns the merged row statistics ``(m, s, x_t, d)``
    (``_merge``) and the fp32 gradients ``(dE (N, H), dC (V_local, H), dbias (V_local,))``
    (None where not needed)."""
    K = o.backend
    cfg = K.default_config(e2.device)
    need_de, need_dc = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    n, h = e2.shape
    v = c.shape[0]
    dev = e2.device
    f32 = torch.float32
    valid = t2 != o.ignore_index
    one = torch.ones((), dtype=f32, device=dev)
    scale = one / valid.sum().clamp(min=1) if o.reduction == "mean" else one
    g = torch.where(valid, scale, torch.zeros((), dtype=f32, device=dev))
    row_stats = torch.empty((4, n), dtype=f32, device=dev)
    de = torch.empty((n, h), dtype=f32, device=dev) if need_de else None
    dc = (torch.zeros if n == 0 else torch.empty)((v, h), dtype=f32, device=dev) if need_dc else None
    db = torch.zeros((v,), dtype=f32, device=dev) if need_db else None
    rows = K.gif_chunk_rows(n, v, cfg)
    xbuf = torch.empty((rows, v), dtype=f32, device=dev) if n else None
    for i, r0 in enumerate(range(0, n, rows)):
        r1 = min(n, r0 + rows)
        x = xbuf[:r1 - r0]
        er, tr = e2[r0:r1], t2[r0:r1]
        K.chunk_logits(er, c, x, cfg)
        stats = K.rows_stats(x, bias, tr, v_offset, o.softcap, o.smoothing > 0, cfg)
        m_r, s_r, tgt_r, d_r = _merge(stats, v, o)
        row_stats[:, r0:r1] = torch.stack([m_r, s_r, tgt_r, d_r])
        coef = _coef(m_r + torch.log(s_r), g[r0:r1], o, v_global)  # token_loss's lse
        dz = K.rows_dz_inplace(x, bias, tr, v_offset, coef, o.softcap, e2.dtype, cfg)
        if need_de:
            K.gemm_store(de[r0:r1], dz, c, cfg, None)
        if need_dc:
            if i == 0:
                K.gemm_store(dc, dz.t(), er, cfg, None)
            else:
                K.gemm_acc(dc, dz.t(), er, cfg)
        if need_db:
            db += dz.sum(dim=0, dtype=f32)
    return row_stats.unbind(0), (de, dc, db)


def _use_grad_in_forward(backend, e, c, bias, reduction, shift, sequence_parallel, group) -> bool:
    if backend is TorchBackend or reduction == "none" or not torch.is_grad_enabled():
        return False
    if not (e.requires_grad or c.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    cfg = backend.default_config(e.device)
    if cfg.grad_in_forward == "always":
        return True
    if cfg.grad_in_forward != "auto":
        return False
    h = e.shape[-1]
    n = e.numel() // max(h, 1) * (communication.world_size(group) if sequence_parallel else 1)
    return backend.gif_extra_bytes(n, c.shape[0], h, cfg) <= cfg.gif_max_bytes


def linear_loss(e, c, bias, targets, backend, *, ignore_index: int, softcap, reduction: str,
                shift: int, group, sequence_parallel: bool, smoothing: float, z_loss: float):
    """The loss and per-token lse of checked arguments (``functional.linear_cross_entropy``)."""
    o = _Opts(ignore_index=ignore_index, softcap=softcap, reduction=reduction, shift=shift,
              group=group,
              sequence_parallel=sequence_parallel and communication.world_size(group) > 1,
              smoothing=smoothing, z_loss=z_loss, backend=backend,
              grad_in_forward=_use_grad_in_forward(backend, e, c, bias, reduction, shift,
                                                   sequence_parallel, group))
    return _LinearCrossEntropy.apply(e, c, bias, targets, o)
