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

Math (DESIGN.md section 1), per token with global logits ``x``, target ``t``, smoothing ``a``,
z-loss ``z``, global vocabulary ``V``::

    loss = (1-a) (lse - x_t) + a (lse - sum_j x_j / V) + z lse^2
    dx_j = g (softmax_j (1 + 2 z lse) - (1-a) [j == t] - a / V)

with the softcap chain rule ``dz = dx (1 - tanh^2)`` when ``x = softcap tanh(z / softcap)``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from . import _checks, distributed

try:  # Triton is optional at import time: the PyTorch path covers its absence
    from .kernels import linear_cross_entropy as _triton_kernels
except Exception:  # pragma: no cover - depends on the platform
    _triton_kernels = None

IMPLS = ("auto", "triton", "torch")

#: Bytes of fp32 logits the ``"torch"`` implementation keeps alive at once (one row chunk).
TORCH_CHUNK_BYTES = 64 * 1024 * 1024


# ----------------------------------------------------------------------------------------------
# The "torch" implementation: chunked PyTorch over row blocks, fp32 throughout
# ----------------------------------------------------------------------------------------------


class _TorchBackend:
    """Same contract as ``kernels.linear_cross_entropy.forward_stats`` / ``backward``.

    Works on any device; computes in fp32 (a copy of ``c`` in fp32 when it is not already) and
    keeps at most one ``(rows, V_local)`` fp32 chunk of logits alive. ``dC`` accumulates in an
    fp32 ``(V_local, H)`` buffer (this fallback trades memory for simplicity; the Triton path
    does not need that buffer).
    """

    @staticmethod
    def _rows(n: int, v: int) -> int:
        return max(1, min(n, TORCH_CHUNK_BYTES // max(1, 4 * v)))

    @staticmethod
    def _logits(e_chunk, c32, b32, softcap):
        z = e_chunk.float() @ c32.t()
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
        stats = torch.empty((4, n), dtype=torch.float32, device=e.device)
        c32 = c.float()
        b32 = bias.float() if bias is not None else None
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
                 need_dbias):
        n, h = e.shape
        v = c.shape[0]
        dev = e.device
        c32 = c.float()
        b32 = bias.float() if bias is not None else None
        de = torch.zeros((n, h), dtype=torch.float32, device=dev) if need_de else None
        dc32 = torch.zeros((v, h), dtype=torch.float32, device=dev) if need_dc else None
        db = torch.zeros((v,), dtype=torch.float32, device=dev) if need_dbias else None
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
                dc32.addmm_(dx.t(), e[r0:r1].float())
            if need_dbias:
                db += dx.sum(dim=0)
            del dx
        dc = dc32.to(c.dtype) if need_dc else None
        return de, dc, db


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _backend(impl: str, t: torch.Tensor):
    if impl == "torch":
        return _TorchBackend
    triton_ok = _triton_kernels is not None and (
        t.is_cuda or (t.device.type == "cpu" and _interpreting()))
    if t.dtype == torch.float64:  # the kernels accumulate in fp32: fp64 inputs use PyTorch
        if impl == "triton":
            raise ValueError("impl='triton' supports fp32, bf16 and fp16 inputs; "
                             "use impl='torch' for float64")
        return _TorchBackend
    if impl == "triton":
        if _triton_kernels is None:
            raise ValueError("impl='triton' but Triton could not be imported; use impl='torch'")
        if not triton_ok:
            raise ValueError(f"impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU), "
                             f"got a tensor on {t.device}; use impl='torch' or 'auto'")
        return _triton_kernels
    return _triton_kernels if triton_ok else _TorchBackend


# ----------------------------------------------------------------------------------------------
# Autograd
# ----------------------------------------------------------------------------------------------


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
        e = distributed.gather_along_first_dim(e, o.group)
    full_shape = e.shape
    if o.shift:
        e = e[..., :-o.shift, :] if e.shape[-2] > o.shift else e[..., :0, :]
        targets = targets[..., o.shift:]
    return e.reshape(-1, e.shape[-1]), targets.reshape(-1), full_shape, e.shape


def _merge(stats: torch.Tensor, group):
    """All-gather ``(4, N)`` local statistics; returns global lse, target logit, sum of logits."""
    g = distributed.gather_stats(stats, group)  # (world, 4, N)
    if g.shape[0] == 1:
        return g[0, 0] + torch.log(g[0, 1]), g[0, 2], g[0, 3]
    m = g[:, 0].amax(dim=0)
    lse = m + torch.log((g[:, 1] * torch.exp(g[:, 0] - m)).sum(dim=0))
    return lse, g[:, 2].sum(dim=0), g[:, 3].sum(dim=0)


def _coef(lse, g, o: _Opts, v_global: int, grad_lse=None):
    """Per-row coefficients ``(4, N)``: lse, softmax weight, one-hot weight, constant."""
    a, z = o.smoothing, o.z_loss
    gp = g * (1.0 + 2.0 * z * lse) if z > 0 else g
    if grad_lse is not None:
        gp = gp + grad_lse
    return torch.stack([lse, gp, g * (1.0 - a), g * (a / v_global)])


def _token_loss(lse, tgt, sumx, t2, o: _Opts, v_global: int):
    a, z = o.smoothing, o.z_loss
    loss = lse - tgt
    if a > 0:
        loss = (1.0 - a) * loss + a * (lse - sumx / v_global)
    if z > 0:
        loss = loss + z * lse * lse
    valid = t2 != o.ignore_index
    in_range = (t2 >= 0) & (t2 < v_global)
    nan = torch.full((), float("nan"), dtype=torch.float32, device=lse.device)
    zero = torch.zeros((), dtype=torch.float32, device=lse.device)
    return torch.where(valid, torch.where(in_range, loss, nan), zero), valid


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, bias, targets, o: _Opts):
        ctx.set_materialize_grads(False)
        world, rank = distributed.world_size(o.group), distributed.rank(o.group)
        v_local = c.shape[0]
        v_global = v_local * world
        v_offset = rank * v_local
        e2, t2, full_shape, shifted_shape = _rows(e, targets, o)
        grads = (None, None, None)
        if o.grad_in_forward:
            lse, tgt, sumx, grads = _forward_with_grads(ctx, e2, c, bias, t2, o, v_global,
                                                        v_offset)
        else:
            stats = o.backend.forward_stats(e2, c, bias, t2, v_offset, o.softcap,
                                            o.smoothing > 0)
            lse, tgt, sumx = _merge(stats, o.group)
        loss, valid = _token_loss(lse, tgt, sumx, t2, o, v_global)

        count = valid.sum() if o.reduction == "mean" else None
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
            coef = _coef(lse, _token_grad(grad_loss, t2, count, o), o, v_global,
                         grad_lse.reshape(-1).float() if grad_lse is not None else None)
            de32, dc, db = o.backend.backward(e2, c, bias, t2, v_offset, coef, o.softcap,
                                              need_de, need_dc, need_db)
        de = None
        if need_de:
            if not o.sequence_parallel:  # else the reduce-scatter below does the sum
                de32 = distributed.all_reduce_sum(de32, o.group)
            if o.shift and not o.sequence_parallel:
                # round straight into the input-dtype gradient: no fp32 copy of the full shape
                de = _unshifted(de32, full_shape, shifted_shape, e.dtype)
            else:
                # the reduce-scatter splits the full sequence: pad it in fp32 first
                de32 = (_unshifted(de32, full_shape, shifted_shape, torch.float32) if o.shift
                        else de32.view(full_shape))
                if o.sequence_parallel:
                    de32 = distributed.reduce_scatter_along_first_dim(de32, o.group)
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


def _token_grad(grad_loss, t2, count, o: _Opts):
    """Per-token upstream gradient of the loss (0 for ignored tokens)."""
    n, dev = t2.numel(), t2.device
    valid = t2 != o.ignore_index
    if grad_loss is None:
        g = torch.zeros(n, dtype=torch.float32, device=dev)
    elif o.reduction == "none":
        g = grad_loss.reshape(-1).float()
    elif o.reduction == "sum":
        g = grad_loss.float().expand(n)
    else:
        g = (grad_loss.float() / count.clamp(min=1)).expand(n)
    return torch.where(valid, g, torch.zeros((), dtype=torch.float32, device=dev))


def _forward_with_grads(ctx, e2, c, bias, t2, o: _Opts, v_global: int, v_offset: int):
    """Scalar loss: statistics and both gradients (for an upstream gradient of 1) in one pass
    over materialized fp32 row chunks of the logits (Triton backend only; see
    ``LCEConfig.grad_in_forward``). Returns lse, target logit, sum of logits and the fp32
    gradients ``(dE (N, H), dC (V_local, H), dbias (V_local,))`` (None where not needed)."""
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
    lse = torch.empty(n, dtype=f32, device=dev)
    tgt = torch.empty(n, dtype=f32, device=dev)
    sumx = torch.empty(n, dtype=f32, device=dev)
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
        lse_r, tgt_r, sumx_r = _merge(stats, o.group)
        lse[r0:r1], tgt[r0:r1], sumx[r0:r1] = lse_r, tgt_r, sumx_r
        coef = _coef(lse_r, g[r0:r1], o, v_global)
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
    return lse, tgt, sumx, (de, dc, db)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def _validate(e, c, targets, bias, ignore_index, softcap, reduction, shift, group,
              sequence_parallel, label_smoothing, z_loss, impl):
    _checks.check_float("e", e)
    _checks.check_float("c", c)
    _checks.check_target_dtype(targets)
    _checks.check_smoothing(label_smoothing)
    _checks.check_reduction(reduction)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if e.dim() < 2:
        raise ValueError(f"e must be (..., H) with at least one leading dim, got shape {tuple(e.shape)}")
    if c.dim() != 2:
        raise ValueError(f"c must be (V_local, H), got shape {tuple(c.shape)}")
    if c.shape[0] < 1:
        raise ValueError("c must hold at least one vocabulary row")
    if e.shape[-1] != c.shape[1]:
        raise ValueError(f"e and c disagree on the hidden size H: e {tuple(e.shape)}, "
                         f"c {tuple(c.shape)}")
    if e.dtype != c.dtype:
        raise ValueError(f"e and c must have the same dtype, got {e.dtype} and {c.dtype}")
    if bias is not None:
        _checks.check_float("bias", bias)
        if tuple(bias.shape) != (c.shape[0],):
            raise ValueError(f"bias must be (V_local,) = ({c.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != c.dtype:
            raise ValueError(f"bias dtype {bias.dtype} differs from c's {c.dtype}")
    _checks.check_same_device(e=e, c=c, targets=targets, bias=bias)
    if float(z_loss) < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if isinstance(shift, bool) or int(shift) != shift or shift < 0:
        raise ValueError(f"shift must be a non-negative int, got {shift!r}")
    lead = list(e.shape[:-1])
    if sequence_parallel:
        lead[0] *= distributed.world_size(group)
    _checks.check_leading_shape(
        "leading dims of e" + (" (gathered over the TP group)" if sequence_parallel else ""),
        torch.Size(lead), targets)


def _use_grad_in_forward(backend, e, c, bias, reduction, shift, sequence_parallel, group) -> bool:
    if backend is _TorchBackend or reduction == "none" or not torch.is_grad_enabled():
        return False
    if not (e.requires_grad or c.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    cfg = backend.default_config(e.device)
    if cfg.grad_in_forward == "always":
        return True
    if cfg.grad_in_forward != "auto":
        return False
    h = e.shape[-1]
    n = e.numel() // max(h, 1) * (distributed.world_size(group) if sequence_parallel else 1)
    return backend.gif_extra_bytes(n, c.shape[0], h, cfg) <= cfg.gif_max_bytes


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    shift: int = 0,
    return_lse: bool = False,
    *,
    tp_group=None,
    sequence_parallel: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    impl: str = "auto",
):
    """Cross entropy of ``e @ c.T (+ bias)`` over the full (TP-sharded) vocabulary, fused.

    Parameters
    ----------
    e : ``(..., H)`` hidden states (float). With ``sequence_parallel=True`` this rank's shard of
        the first dim; it is all-gathered over ``tp_group`` (Megatron's output-layer layout).
    c : ``(V_local, H)`` this rank's classifier rows; rank ``r`` holds global classes
        ``[r * V_local, (r + 1) * V_local)``. Same dtype and device as ``e``.
    targets : integer tensor with ``e``'s (gathered) leading shape, global class ids.
    bias : optional ``(V_local,)``.
    ignore_index : tokens with this target get loss 0 and gradient 0.
    softcap : logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    reduction : ``"mean"`` (over non-ignored tokens; 0 when none), ``"sum"`` or ``"none"``.
    shift : drop the last ``shift`` positions of ``e`` along dim -2 and the first ``shift``
        targets (``shift=1``: causal LM with unshifted labels).
    return_lse : also return the per-token fp32 log-sum-exp (differentiable).
    tp_group : tensor-parallel process group (None: no parallelism).
    label_smoothing : PyTorch's convention, over the global vocabulary.
    z_loss : adds ``z_loss * lse**2`` per (non-ignored) token.
    impl : ``"triton"``, ``"torch"`` (chunked PyTorch) or ``"auto"`` (Triton on CUDA or under
        ``TRITON_INTERPRET=1``, else PyTorch).

    Returns
    -------
    The fp32 loss (scalar, or per token for ``reduction="none"``, shaped like the shifted
    targets), and with ``return_lse=True`` the tuple ``(loss, lse)``. Every rank returns the
    full-vocabulary values. A target outside ``[0, V)`` that is not ``ignore_index`` gives a NaN
    loss for that token (no out-of-bounds read). The gradient of ``c`` is this rank's slice; the
    gradient of ``e`` is the full gradient (summed over the group in fp32, rounded once).
    Deterministic: no atomics; every sum is taken in a fixed order.
    """
    _validate(e, c, targets, bias, ignore_index, softcap, reduction, shift, tp_group,
              sequence_parallel, label_smoothing, z_loss, impl)
    distributed.check_equal_shards(c.shape[0], tp_group, c.device)
    if _checks.targets_check_requested(None):
        _checks.check_target_range(targets, c.shape[0] * distributed.world_size(tp_group),
                                   ignore_index)
    backend = _backend(impl, e)
    o = _Opts(ignore_index=int(ignore_index), softcap=float(softcap) if softcap else None,
              reduction=reduction, shift=int(shift), group=tp_group,
              sequence_parallel=bool(sequence_parallel) and distributed.world_size(tp_group) > 1,
              smoothing=float(label_smoothing), z_loss=float(z_loss),
              backend=backend,
              grad_in_forward=_use_grad_in_forward(backend, e, c, bias, reduction, shift,
                                                   sequence_parallel, tp_group))
    loss, lse = _LinearCrossEntropy.apply(e, c, bias, targets, o)
    return (loss, lse) if return_lse else loss
