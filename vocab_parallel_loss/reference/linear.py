"""Pure-PyTorch backend of the fused linear cross entropy: chunked over row blocks, fp32 (fp64
for float64 inputs).

Same contract as the Triton backend (``kernels.linear.forward_stats`` / ``backward``); the
fallback without Triton or a GPU, and the backend for float64 inputs.
"""

from __future__ import annotations

import torch

from ..formulas import compute_dtype

#: Bytes of fp32 logits the ``"torch"`` implementation keeps alive at once (one row chunk).
TORCH_CHUNK_BYTES = 64 * 1024 * 1024


class TorchBackend:
    """Same contract as ``kernels.linear.forward_stats`` / ``backward``.

    Works on any device; computes in fp32, or fp64 for float64 inputs (a copy of ``c`` in that
    dtype when it is not already), and keeps at most one ``(rows, V_local)`` chunk of logits
    alive. ``dC`` accumulates in an
    fp32 ``(V_local, H)`` buffer (this fallback trades memory for simplicity; the Triton path
    does not need that buffer).
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

    @classmethod
    def forward_stats(cls, e, c, bias, targets, v_offset, softcap, need_sumx):
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
            stats[1, r0:r1] = torch.exp(x - m[:, None]).sum(dim=1)
            idx, inr = cls._local_targets(targets[r0:r1], v_offset, v)
            tg = x.gather(1, idx[:, None])[:, 0]
            stats[2, r0:r1] = torch.where(inr, tg, torch.zeros_like(tg))
            stats[3, r0:r1] = x.sum(dim=1) if need_sumx else 0.0
            del x
        return stats

    @classmethod
    def backward(cls, e, c, bias, targets, v_offset, coef, softcap, need_de, need_dc,
                 need_dbias, dc_acc=None):
        """``(dE, dC in c.dtype, dbias)``; with ``dc_acc`` dC is added into it instead (rounded
        once there) and returned as None."""
        n, h = e.shape
        v = c.shape[0]
        dev = e.device
        acc = compute_dtype(e.dtype)
        c32 = c.to(acc)
        b32 = bias.to(acc) if bias is not None else None
        de = torch.zeros((n, h), dtype=acc, device=dev) if need_de else None
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
            if need_de:
                de[r0:r1] = dx @ c32
            if need_dc:
                dc32.addmm_(dx.t(), e[r0:r1].to(acc))
            if need_dbias:
                db += dx.sum(dim=0)
            del dx
        if need_dc and dc_acc is not None:
            dc_acc.add_(dc32)
            return de, None, db
        dc = dc32.to(c.dtype) if need_dc else None
        return de, dc, db
