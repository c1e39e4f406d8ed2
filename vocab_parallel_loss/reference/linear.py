"""Pure-PyTorch backend of the fused linear engine: the loss's statistics and gradients chunked
over row blocks, the log-prob mode's over column chunks; fp32 (fp64 for float64 inputs).

Same contract as the Triton backend (``kernels.linear.forward_stats`` / ``backward``, with
``logprob=LogprobArgs`` the log-prob mode); the fallback without Triton or a GPU, and the
backend for float64 inputs.

Batch-invariant statistics (``forward_stats(..., invariant=True)``) take blocks of one shape:
``logprobs.invariant_rows`` rows of ``e`` (the last block padded with zero rows) by at most
``INVARIANT_COLS`` columns of ``c`` (padded with zero rows to ``logprobs.INVARIANT_ALIGN``), so
that every GEMM and reduction has the same shape whatever the rows, and the column blocks'
statistics are merged by ``formulas.ordered_sum``.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..formulas import (LOG_UNDERFLOW, LogprobArgs, compute_dtype, merge_logprob_stats,
                        merge_partial_stats)
from ..layout import RowView
from ..runtime import compiling, no_autocast
from . import logprobs as rows

#: Bytes of fp32 logits the ``"torch"`` implementation keeps alive at once (one row chunk).
TORCH_CHUNK_BYTES = 64 * 1024 * 1024

#: Bytes of one fp32 column chunk of logits in the log-prob mode (fp64 for float64 inputs):
#: 128 MiB keeps the GEMMs at 16384 x 2048 x H, full size on the H200.
LOGPROB_CHUNK_BYTES = 128 * 1024 * 1024

#: Columns of one batch-invariant block at most (a multiple of ``logprobs.INVARIANT_ALIGN``).
INVARIANT_COLS = 16384


@contextlib.contextmanager
def _fp32_matmuls(device: torch.device, precision):
    """fp32 GEMMs on CUDA in IEEE fp32 (``"fp32"``) or TF32 (``"tf32"``) whatever PyTorch's
    global setting, restored after (``set_float32_matmul_precision`` works alongside either of
    PyTorch's TF32 flags). A traced graph keeps the setting it was compiled under."""
    if device.type != "cuda" or compiling():
        yield
        return
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _own_precision(fn):
    """``fn(cls, e, ...)`` with autocast off on ``e``'s device: the GEMMs run in the backend's
    fp32 (fp64), as the Triton kernels do, not in autocast's bf16 or fp16; fp32 GEMMs in the
    call's ``precision`` (``checks.FP32_PRECISIONS``)."""
    @functools.wraps(fn)
    def run(cls, e, *args, precision=None, **kw):
        with no_autocast(e.device), _fp32_matmuls(e.device, precision):
            return fn(cls, e, *args, **kw)
    return run


class TorchBackend:
    """Same contract as ``kernels.linear.forward_stats`` / ``backward``.

    Works on any device; computes in fp32, or fp64 for float64 inputs (a copy of ``c`` in that
    dtype when it is not already), and keeps at most one ``(rows, V_local)`` chunk of logits
    alive. The loss's ``dC`` accumulates in an fp32 ``(V_local, H)`` buffer (this fallback
    trades memory for simplicity; the Triton path does not need that buffer); the log-prob
    mode forms each column chunk's ``dC`` rows at once.
    """

    #: Backend capabilities (``backends.LinearBackend``)
    NAME = "torch"
    TRACEABLE = True
    STRATEGIES = ("recompute",)

    @staticmethod
    def _rows(n: int, v: int) -> int:
        return max(1, min(n, TORCH_CHUNK_BYTES // max(1, 4 * v)))

    @staticmethod
    def _logits(e_chunk, c32, b32, softcap):
        z = e_chunk.to(c32.dtype) @ c32.t()
        if b32 is not None:
            z = z + b32
        if softcap:
            th = torch.tanh(z / softcap)
            return softcap * th, th
        return z, None

    @staticmethod
    def _local_targets(t, v_offset, v):
        tl = t.long() - v_offset
        inr = (tl >= 0) & (tl < v)
        return tl.clamp(0, v - 1), inr

    @staticmethod
    def _cols(n: int, v: int, acc) -> int:
        """Columns of one log-prob chunk: a multiple of 256 of ``LOGPROB_CHUNK_BYTES``."""
        size = torch.finfo(acc).bits // 8
        return min(v, max(256, (LOGPROB_CHUNK_BYTES // max(1, n * size)) // 256 * 256))

    @classmethod
    @_own_precision
    def forward_stats(cls, e, c, bias, targets, v_offset, softcap, need_sumx,
                      logprob: LogprobArgs = None, invariant: bool = False):
        """``(4, N)`` statistics of the loss; with ``logprob`` the ``(5, N)`` log-prob
        statistics (``need_sumx`` ignored); ``invariant``: batch-invariant (the module doc)."""
        if invariant:
            return cls._invariant_stats(e, c, bias, targets, v_offset, softcap, need_sumx,
                                        logprob)
        if logprob is not None:
            return cls._logprob_stats(e, c, bias, targets, v_offset, softcap, logprob)
        n, v = e.shape[0], c.shape[0]
        acc = compute_dtype(e.dtype)
        stats = torch.empty((4, n), dtype=acc, device=e.device)
        c32 = c.to(acc)
        b32 = bias.to(acc) if bias is not None else None
        step = cls._rows(n, v)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            x, _ = cls._logits(e[r0:r1], c32, b32, softcap)
            m = x.amax(dim=1)
            stats[0, r0:r1] = m
            # a row of masked (-inf) columns sums exp(-inf) = 0, not exp(-inf - -inf) = NaN
            m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
            stats[1, r0:r1] = torch.exp(x - m_safe[:, None]).sum(dim=1)
            idx, inr = cls._local_targets(targets[r0:r1], v_offset, v)
            tg = x.gather(1, idx[:, None])[:, 0]
            stats[2, r0:r1] = torch.where(inr, tg, torch.zeros_like(tg))
            stats[3, r0:r1] = x.sum(dim=1) if need_sumx else 0.0
            del x
        return stats

    @classmethod
    def _invariant_stats(cls, e, c, bias, targets, v_offset, softcap, need_sumx,
                         lp: LogprobArgs = None):
        """``forward_stats`` in blocks of one shape (the module doc)."""
        n, h = e.shape
        v = c.shape[0]
        acc = compute_dtype(e.dtype)
        dev = e.device
        k = 4 if lp is None else 5
        if n == 0 or v == 0:  # no rows, or no columns: the merge's neutral element
            stats = torch.zeros((k, n), dtype=acc, device=dev)
            stats[0] = float("-inf")
            return stats
        vp = rows.padded_width(v)
        cols = min(INVARIANT_COLS, vp)
        block = rows.invariant_rows(cols)
        ea = torch.zeros((-(-n // block) * block, h), dtype=acc, device=dev)
        ea[:n] = e
        ca = torch.zeros((vp, h), dtype=acc, device=dev)
        ca[:v] = c
        ba = None
        if bias is not None:
            ba = torch.zeros((vp,), dtype=acc, device=dev)
            ba[:v] = bias
        tp = torch.full((ea.shape[0],), -1, dtype=torch.long, device=dev)
        tp[:n] = targets.long() - v_offset  # local columns; -1 in no block
        inv = None
        if lp is not None:
            inv = lp.inv_t.to(acc)
            if inv.numel() == 1:
                inv = inv.reshape(1, 1)
            else:
                inv = torch.ones((ea.shape[0], 1), dtype=acc, device=dev)
                inv[:n, 0] = lp.inv_t.to(acc)
        stats = torch.empty((k, n), dtype=acc, device=dev)
        merge = merge_partial_stats if lp is None else merge_logprob_stats
        for r0 in range(0, n, block):
            r1 = min(n, r0 + block)
            er = ea[r0:r0 + block]
            parts = []
            for c0 in range(0, vp, cols):
                c1 = min(vp, c0 + cols)
                z = er @ ca[c0:c1].t()
                if ba is not None:
                    z = z + ba[c0:c1]
                t_local = tp[r0:r0 + block] - c0
                if lp is not None:
                    ir = inv if inv.shape[0] == 1 else inv[r0:r0 + block]
                    parts.append(rows.padded_stats(z, t_local, ir, min(v, c1) - c0,
                                                   v_offset + c0, lp.scale, softcap))
                else:
                    parts.append(cls._padded_loss_stats(z, t_local, min(v, c1) - c0, softcap,
                                                        need_sumx))
            part = torch.stack(merge(torch.stack(parts), ordered=True))
            stats[:, r0:r1] = part[:, :r1 - r0]
        return stats

    @classmethod
    def _padded_loss_stats(cls, z, t_local, valid: int, softcap, need_sumx: bool):
        """The loss's ``(4, rows)`` statistics of a block of raw logits whose columns at or
        past ``valid`` are padding; every reduction over all of its columns."""
        x = softcap * torch.tanh(z / softcap) if softcap else z
        live = torch.arange(z.shape[1], device=z.device)[None, :] < valid
        xm = torch.where(live, x, torch.full((), float("-inf"), dtype=x.dtype, device=x.device))
        m = xm.amax(dim=1)
        m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        s = torch.exp(xm - m_safe[:, None]).sum(dim=1)
        inr = (t_local >= 0) & (t_local < valid)
        tg = x.gather(1, torch.where(inr, t_local, torch.zeros_like(t_local))[:, None])[:, 0]
        tg = torch.where(inr, tg, torch.zeros_like(tg))
        sx = (torch.where(live, x, torch.zeros_like(x)).sum(dim=1) if need_sumx
              else torch.zeros_like(m))
        return torch.stack([m, s, tg, sx])

    @classmethod
    @_own_precision
    def backward(cls, e, c, bias, targets, v_offset, coef, softcap, need_de, need_dc,
                 need_dbias, de_acc=None, dc_out=None, dc_acc=None,
                 logprob: LogprobArgs = None):
        """``(dE, dC in c.dtype, dbias)``, dE and dbias in the accumulation dtype. ``coef``:
        ``(4, N)`` rows lse, gp, gt, gc of the loss, or with ``logprob`` ``(6, N)`` (its sixth
        row ``gx`` weighs ``softmax_j (x_j - lse)``, the fifth is unused). ``de_acc``: a dE to
        add to; ``dc_out``: where dC goes; with ``dc_acc`` dC is added into it instead (rounded
        once there) and returned as None."""
        if logprob is not None:
            return cls._logprob_backward(e, c, bias, targets, v_offset, coef, softcap, need_de,
                                         need_dc, need_dbias, de_acc, dc_out, dc_acc, logprob)
        n, h = e.shape
        v = c.shape[0]
        dev = e.device
        acc = compute_dtype(e.dtype)
        c32 = c.to(acc)
        b32 = bias.to(acc) if bias is not None else None
        de = (de_acc if de_acc is not None
              else torch.zeros((n, h), dtype=acc, device=dev)) if need_de else None
        dc32 = torch.zeros((v, h), dtype=acc, device=dev) if need_dc else None
        db = torch.zeros((v,), dtype=acc, device=dev) if need_dbias else None
        step = cls._rows(n, v)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            x, th = cls._logits(e[r0:r1], c32, b32, softcap)
            lse, gp, gt, gc = coef[:, r0:r1]
            dx = gp[:, None] * torch.exp(x - lse[:, None]) - gc[:, None]
            del x
            idx, inr = cls._local_targets(targets[r0:r1], v_offset, v)
            dx.scatter_add_(1, idx[:, None], torch.where(inr, -gt, torch.zeros_like(gt))[:, None])
            if th is not None:
                dx = dx * (1.0 - th * th)
                del th
            if need_de and de_acc is not None:
                de[r0:r1].addmm_(dx, c32)
            elif need_de:
                de[r0:r1] = dx @ c32
            if need_dc:
                dc32.addmm_(dx.t(), e[r0:r1].to(acc))
            if need_dbias:
                db += dx.sum(dim=0)
            del dx
        if need_dc and dc_acc is not None:
            dc_acc.add_(dc32)
            return de, None, db
        dc = None
        if need_dc and dc_out is not None:
            dc = dc_out.copy_(dc32)
        elif need_dc:
            dc = dc32.to(c.dtype)
        return de, dc, db

    @classmethod
    def _logprob_stats(cls, e, c, bias, targets, v_offset, softcap, lp: LogprobArgs):
        """The ``(5, N)`` log-prob statistics (``reference.logprobs.stats``), one column chunk
        of logits alive at a time, merged in column order."""
        n, v = e.shape[0], c.shape[0]
        acc = compute_dtype(e.dtype)
        if n == 0 or v == 0:  # no rows, or no columns: the merge's neutral element
            stats = torch.zeros((5, n), dtype=acc, device=e.device)
            stats[0] = float("-inf")
            return stats
        step = cls._cols(n, v, acc)
        parts = torch.empty((-(-v // step), 5, n), dtype=acc, device=e.device)
        ea = e.to(acc)
        for k, c0 in enumerate(range(0, v, step)):
            c1 = min(v, c0 + step)
            z = cls._chunk_logits(ea, c[c0:c1], None if bias is None else bias[c0:c1])
            rows.stats(RowView(z, n, 0, z.stride(0)), targets, lp.inv_t, v_offset + c0, c1 - c0,
                       lp.scale, softcap, parts[k])
            del z
        return torch.stack(merge_logprob_stats(parts))

    @staticmethod
    def _chunk_logits(ea, c_chunk, b_chunk):
        z = ea @ c_chunk.to(ea.dtype).t()
        return z if b_chunk is None else z.add_(b_chunk.to(ea.dtype))

    @classmethod
    def _logprob_backward(cls, e, c, bias, targets, v_offset, coef, softcap, need_de, need_dc,
                          need_dbias, de_acc, dc_out, dc_acc, lp: LogprobArgs):
        """The log-prob mode's gradients by column chunks: per chunk the logits recomputed,
        ``dx_j = (gp + gx (x_j - lse)) p_j - gc - gt [j == t]`` times ``dx/dz`` (softcap, logit
        scale, ``inv_t``), then ``dE += dz C_chunk`` and the chunk's dC rows ``dz.T E`` (each
        rounded once, or added into ``dc_acc``)."""
        n, h = e.shape
        v = c.shape[0]
        dev = e.device
        acc = compute_dtype(e.dtype)
        de = (de_acc if de_acc is not None
              else torch.zeros((n, h), dtype=acc, device=dev)) if need_de else None
        dc = ((dc_out if dc_out is not None
               else torch.empty_like(c, memory_format=torch.contiguous_format))
              if need_dc and dc_acc is None else None)
        db = torch.zeros((v,), dtype=acc, device=dev) if need_dbias else None
        if n == 0 or not (need_de or need_dc or need_dbias):
            if dc is not None:
                dc.zero_()
            return de, dc, db
        lse, gp, gt, gc, _, gx = (r[:, None] for r in coef.to(acc))
        inv_t = lp.inv_t.to(acc)
        inv_t = inv_t[:, None] if inv_t.numel() > 1 else inv_t
        ea = e.to(acc)
        step = cls._cols(n, v, acc)
        for c0 in range(0, v, step):
            c1 = min(v, c0 + step)
            ck = c[c0:c1].to(acc)
            z = cls._chunk_logits(ea, ck, None if bias is None else bias[c0:c1])
            x, slope = rows.transform(z, inv_t, lp.scale, softcap)
            del z
            # clamped where p underflows anyway: gx * d * p is 0, not NaN, at a -inf logit
            d = x.sub_(lse).clamp_(min=LOG_UNDERFLOW)
            dz = (gp + gx * d).mul_(torch.exp(d)).sub_(gc)
            del x, d
            idx, inr = cls._local_targets(targets, v_offset + c0, c1 - c0)
            gt_in = torch.where(inr, -gt[:, 0], torch.zeros_like(gt[:, 0]))
            dz.scatter_add_(1, idx[:, None], gt_in[:, None])
            dz.mul_(slope)
            del slope
            if need_de:
                de.addmm_(dz, ck)
            if need_dc and dc_acc is not None:
                dc_acc[c0:c1].add_(dz.t() @ ea)  # fp32 product, rounded once into dc_acc
            elif need_dc:
                dc[c0:c1] = dz.t() @ ea  # each dC row once, rounded once
            if need_dbias:
                db[c0:c1] = dz.sum(dim=0)
            del dz
        return de, dc, db
