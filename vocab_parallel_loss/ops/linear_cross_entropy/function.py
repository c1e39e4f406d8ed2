"""Fused linear cross entropy, vocab-parallel: the loss from hidden states and this rank's
classifier rows, without materializing the ``(N, V_local)`` logits.

Forward (per rank): one fused pass gives per-row statistics of the local logits (max, sum of
exponentials, target logit, sum of logits); one all-gather of those ``4 x N`` floats over the TP
group and a merge give the full-vocabulary lse and loss on every rank. Saved for backward: the
inputs, the flat targets and the lse (O(N)).

Backward, by the strategy ``memory_budget`` allows (``strategy.py``): from the logits tiles the
forward saved (6NHV), from gradients already formed in forward (scalar losses, and per-token
losses given their loss mask, ``masked.py``; 6NHV), or by
recomputing the logits chunk by chunk (8NHV); each forms ``dlogits`` from the saved lse and
accumulates ``dE`` and ``dC`` in fp32. ``dC`` is local. ``dE`` is summed over the TP group in
fp32 (all-reduce; with ``sequence_parallel`` a reduce-scatter back to the sequence shard) and
rounded once to the input dtype.

Math (``formulas.py``; docs/design.md), per token with global logits ``x``, target ``t``, smoothing ``a``,
z-loss ``z``, global vocabulary ``V``::

    loss = (1-a) (lse - x_t) + a (lse - sum_j x_j / V) + z lse^2
    dx_j = g (softmax_j (1 + 2 z lse) - (1-a) [j == t] - a / V)

with the softcap chain rule ``dz = dx (1 - tanh^2)`` when ``x = softcap tanh(z / softcap)``.
"""

from __future__ import annotations

import torch

from ... import backends, checks, communication, settings
from ...formulas import merge_stats, out_of_range, relative_sums, token_loss
from ...reference.linear import TorchBackend
from ...runtime import compiling, untraced
from ..fused_linear import compiled_checks
from ..fused_linear.columns import backward_columns, forward_columns
from ...autograd.main_grad import dummy as main_grad_dummy, home as main_grad_home
from ...autograd.first_order import consume, refuse_double_backward, refuse_if_consumed
from ..fused_linear.strategy import choose_strategy, gif_round_dc_first
from . import contract, masked
from .formed import round_formed
from .contract import LinearLossOptions


def _rows(e: torch.Tensor, targets: torch.Tensor, o: LinearLossOptions):
    """Gather (sequence parallel) and flatten: ``(N, H)`` rows, ``(N,)`` targets and the
    gathered shape of ``e``."""
    if o.sequence_parallel:
        # every rank sends the rows the (same) targets give it: see communication.check_shapes
        rows = targets.shape[0] // communication.world_size(o.group)
        e = communication.gather_along_first_dim(e, o.group, rows)
    return e.reshape(-1, e.shape[-1]), targets.reshape(-1), e.shape


def _shifted(x: torch.Tensor, dim: int, shift: int, fill) -> torch.Tensor:
    """``x`` (targets or a loss mask) moved ``shift`` positions back along ``dim``, the last
    ``shift`` positions ``fill``: position i holds what position i + shift held. ``shift``
    then needs no other change: the hidden states and their gradient keep every position, the
    last ones ignored (their gradient exactly 0), and no shifted copy of either is made."""
    kept = max(x.shape[dim] - shift, 0)
    out = torch.full_like(x, fill)
    out.narrow(dim, 0, kept).copy_(x.narrow(dim, x.shape[dim] - kept, kept))
    return out


def _kept(x: torch.Tensor, dim: int, shift: int) -> torch.Tensor:
    """The positions of a per-token output that ``shift`` keeps (all but the last ``shift``
    along ``dim``), contiguous as every output is."""
    return x.narrow(dim, 0, max(x.shape[dim] - shift, 0)).contiguous()


def _shapes(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, o: LinearLossOptions) -> tuple:
    """This rank's shard shapes, gathered with the statistics (``communication.check_shapes``):
    ``(vocabulary rows of c, rows of e, rows of e the targets imply)`` under sequence
    parallelism, else ``(vocabulary rows of c,)``."""
    if o.sequence_parallel:
        return (c.shape[0], e.shape[0], targets.shape[0] // communication.world_size(o.group))
    return (c.shape[0],)


def _merge(stats: torch.Tensor, v_local: int, o: "LinearLossOptions", shapes: tuple):
    """All-gather ``(4, N)`` local statistics of ``v_local`` columns (the backends' format: the
    last row is the sum of logits) with this rank's ``shapes``; returns ``(m, s, x_t, sum (x -
    m))`` of the global row (``m`` NaN when the ranks' shapes disagree) and the gathered buffer
    (None without TP) for ``_check_shapes``."""
    if o.smoothing > 0:
        relative_sums(stats, v_local)
    if communication.world_size(o.group) == 1:
        return merge_stats(stats.unsqueeze(0), v_local), None
    # batch-invariant: the ranks' statistics summed in one order whatever the rows
    n = stats.shape[1]
    send = stats.new_zeros(communication.stats_size(4, n))
    send[:4 * n].view(4, n).copy_(stats)
    communication.put_shapes(send, 4, n, shapes[:2])
    gathered = communication.gather_stats(send, o.group)
    m, s, x_t, d = merge_stats(communication.gathered_stats(gathered, 4, n), v_local,
                               ordered=o.invariant)
    agree = communication.shapes_agree(communication.gathered_shapes(gathered, 4, n), shapes)
    return (_nan_unless(agree, m), s, x_t, d), gathered


def _nan_unless(ok: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.where(ok, x, torch.full_like(x, float("nan")))


def _check_shapes(gathered, m, shapes: tuple, group):
    """Raise on every rank whose shapes are new to it when the ranks' shapes disagree; called
    after the forward's last collective, so that no rank raises while others still gather.
    Returns the row max ``m`` (under torch.compile the check is an op that it depends on)."""
    if gathered is None:
        return m
    n = (gathered.shape[1] - communication.SHAPE_SLOTS) // 4
    if compiling():
        agree = compiled_checks.shapes_agree(gathered, 4, n, list(shapes),
                                          communication.group_key(group))
        return _nan_unless(agree, m)
    communication.check_shapes(gathered, 4, n, shapes, group)
    return m


def _coef(lse, g, o: LinearLossOptions, v_global: int, grad_lse=None, x_t=None):
    """Per-row coefficients ``(4, N)``: lse, softmax weight, one-hot weight, constant (in the
    lse's dtype: fp32, or fp64 for float64 inputs); with ``x_t`` a fifth row, the target
    logit (the saved-tiles backward)."""
    a, z = o.smoothing, o.z_loss
    gp = g * (1.0 + 2.0 * z * lse) if z > 0 else g
    if grad_lse is not None:
        gp = gp + grad_lse
    rows = [lse, gp, g * (1.0 - a), g * (a / v_global)]
    return torch.stack(rows if x_t is None else rows + [x_t.to(lse.dtype)])


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, bias, targets, o: LinearLossOptions, loss_mask=None):
        ctx.set_materialize_grads(False)
        world, rank = communication.world_size(o.group), communication.rank(o.group)
        v_local = c.shape[0]
        v_global = v_local * world
        v_offset = rank * v_local
        shapes = _shapes(e, c, targets, o)
        e2, t2, full_shape = _rows(e, targets, o)
        kept = (None, None, None)  # grad_in_forward: the gradients; saved: u, tile maxima, x_t
        mask = loss_mask.reshape(-1).to(torch.float32) if o.masked else None
        if o.strategy == "grad_in_forward":
            row_stats, kept, gathered = _forward_with_grads(ctx, e2, c, bias, t2, o, v_global,
                                                            v_offset, shapes, mask)
        else:
            saved_cols = None
            if o.strategy == "saved":
                saved_cols = v_local if o.saved_cols is None else o.saved_cols
            stats, saved = forward_columns(o.backend, e2, c, bias, t2, v_offset, o.softcap,
                                           o.smoothing > 0, saved_cols,
                                           precision=o.fp32_precision, invariant=o.invariant,
                                           room=o.room)
            if saved is not None:
                ctx.tile_v = saved.block_v
            row_stats, gathered = _merge(stats, v_local, o, shapes)
            if o.strategy == "saved":
                kept = (saved.u, saved.tile_max, row_stats[2])
        m = _check_shapes(gathered, row_stats[0], shapes, o.group)
        loss, lse, ignored, bad = token_loss(t2, m, *row_stats[1:], v_global, o.ignore_index,
                                             o.smoothing, o.z_loss)
        # a target outside the vocabulary: NaN lse and gradient, as the loss over logits gives
        lse = _nan_unless(~bad, lse)

        count = (~ignored).sum() if o.reduction == "mean" else None
        if o.strategy == "grad_in_forward":
            # not saved tensors: backward releases each fp32 accumulator once it is rounded
            ctx.formed, kept = list(kept), (() if mask is None else (mask,))
        ctx.save_for_backward(e, c, bias, targets, lse, count, *kept)
        ctx.o = o
        ctx.meta = (v_global, v_offset, full_shape)

        lse_out = lse.view(full_shape[:-1])
        if compiling():  # dynamo rejects a saved tensor that is also (a view of) an output
            lse_out = lse_out.clone()
        if o.reduction == "none":
            out = loss.view(full_shape[:-1])
        elif o.reduction == "sum":
            out = loss.sum()
        else:
            out = loss.sum() / count.clamp(min=1)
        return out, lse_out

    @staticmethod
    def backward(ctx, grad_loss, grad_lse):
        if torch.is_grad_enabled():  # create_graph=True
            refuse_double_backward("linear_cross_entropy")
        refuse_if_consumed(ctx, "linear_cross_entropy")
        e, c, bias, targets, lse, count, *kept = ctx.saved_tensors
        o: LinearLossOptions = ctx.o
        v_global, v_offset, full_shape = ctx.meta
        need_de, need_dc, need_db = ctx.needs_input_grad[0], ctx.needs_input_grad[1], (
            bias is not None and ctx.needs_input_grad[2])
        if grad_loss is None and grad_lse is None:
            return None, None, None, None, None, None
        home = main_grad_home(c, o.main_grad, need_dc)
        if o.strategy == "saved":
            consume(ctx, "its saved logits")
            u, tile_max, x_t = kept
            e2, t2, _ = _rows(e, targets, o)
            coef = _coef(lse, _token_grad(grad_loss, t2, count, o, lse.dtype), o, v_global,
                         grad_lse.reshape(-1).to(lse.dtype) if grad_lse is not None else None,
                         x_t=x_t)
            de32, dc, db = backward_columns(
                o.backend, e2, c, bias, t2, v_offset, coef, o.softcap, need_de, need_dc,
                need_db, saved=o.backend.SavedTiles(u, tile_max, ctx.tile_v),
                de_final=communication.world_size(o.group) == 1, dc_acc=home,
                precision=o.fp32_precision)
        elif o.masked:
            consume(ctx, "the gradients formed in forward")
            formed, ctx.formed = ctx.formed, None
            e2, t2, _ = _rows(e, targets, o)
            coef = _coef(lse, _token_grad(grad_loss, t2, count, o, lse.dtype), o, v_global,
                         grad_lse.reshape(-1).to(lse.dtype) if grad_lse is not None else None)
            de32, dc, db = masked.backward(formed, grad_loss, grad_lse, coef, e, e2, c, bias, t2,
                                           kept[0], o, v_offset,
                                           communication.world_size(o.group), need_de, need_dc,
                                           need_db, home)
        elif o.strategy == "grad_in_forward":
            consume(ctx, "the gradients formed in forward")
            formed, ctx.formed = ctx.formed, None
            de32, dc, db = _backward_formed(formed, grad_loss, grad_lse, e, c, bias, targets,
                                            lse, v_global, v_offset, o, need_de, need_dc,
                                            need_db, home)
        else:
            e2, t2, _ = _rows(e, targets, o)
            coef = _coef(lse, _token_grad(grad_loss, t2, count, o, lse.dtype), o, v_global,
                         grad_lse.reshape(-1).to(lse.dtype) if grad_lse is not None else None)
            de32, dc, db = backward_columns(o.backend, e2, c, bias, t2, v_offset, coef, o.softcap,
                                            need_de, need_dc, need_db,
                                            chunk_bytes=o.chunk_bytes, dc_acc=home,
                                            precision=o.fp32_precision)
        if home is not None:
            dc = main_grad_dummy(c)
        de = None
        if need_de:
            if not o.sequence_parallel:  # else the reduce-scatter below does the sum
                de32 = communication.all_reduce_sum(de32, o.group)
            de32 = de32.view(full_shape)
            if o.sequence_parallel:
                de32 = communication.reduce_scatter_along_first_dim(de32, o.group, e.shape)
            de = de32.to(e.dtype)
        if db is not None:
            db = db.to(bias.dtype)
        return de, dc, db, None, None, None


def _backward_formed(formed: list, grad_loss, grad_lse, e, c, bias, targets, lse,
                     v_global: int, v_offset: int, o: LinearLossOptions, need_de: bool, need_dc: bool,
                     need_db: bool, home=None):
    """Gradients of the strategy that formed them in forward for an upstream gradient of 1:
    ``formed``, the fp32 ``[dE, dC, dbias]``, scaled by the loss's upstream gradient and
    rounded once (``formed.round_formed``). The caller refuses a second backward.
    With the lse output's gradient, its recompute pass adds into the scaled fp32 accumulators
    first. Returns ``(dE fp32 or already in e.dtype, dC in c.dtype or None when added into
    ``home``, dbias)``."""
    gl = (grad_loss.float() if grad_loss is not None
          else torch.zeros((), dtype=torch.float32, device=e.device))
    db = formed[2] * gl if need_db else None
    if grad_lse is not None:
        de32 = formed[0].mul_(gl) if need_de else None
        dc32 = formed[1].mul_(gl) if need_dc else None
        formed.clear()
        e2, t2, _ = _rows(e, targets, o)  # the lse output's gradient: the usual recompute
        coef = _coef(lse, torch.zeros_like(lse), o, v_global, grad_lse.reshape(-1).float())
        x_de, _, x_db = o.backend.backward(e2, c, bias, t2, v_offset, coef, o.softcap, need_de,
                                           need_dc, need_db, dc_acc=dc32)
        if need_de:
            de32.add_(x_de)
        if need_db:
            db = db + x_db
        dc = None
        if need_dc and home is not None:
            home.add_(dc32)  # rounded once into main_grad's dtype
        elif need_dc:
            dc = dc32 if c.dtype == torch.float32 else dc32.to(c.dtype)
        return de32, dc, db

    h = e.shape[-1]
    dc_first = gif_round_dc_first(e.numel() // max(h, 1), c.shape[0], h, e, c, home is not None)
    de, dc = round_formed(formed, gl, e, c, home, o.backend, need_de, need_dc, dc_first)
    return de, dc, db



def _token_grad(grad_loss, t2, count, o: LinearLossOptions, dtype):
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


def _forward_with_grads(ctx, e2, c, bias, t2, o: LinearLossOptions, v_global: int, v_offset: int,
                        shapes: tuple, mask=None):
    """Scalar loss: statistics and both gradients (for an upstream gradient of 1) in forward;
    with ``mask`` (``(N,)`` fp32) a per-token loss's, for the upstream gradient ``mask``
    (``masked.py``). A chunk at a time,
    a chunk of ``o.gif_rows`` rows at a time: the fused forward saves the chunk's logits tiles
    (``saved.py``), its statistics are merged, the tiles become ``dz`` in place, then
    ``dE[rows] = dz @ C`` and ``dC += dz.T @ E[rows]`` (fp32). 6NHV. Returns the merged row
    statistics ``(m, s, x_t, d)`` (``_merge``), the fp32 gradients ``(dE (N, H), dC (V_local,
    H), dbias (V_local,))`` (None where not needed) and the first chunk's gathered statistics
    (for ``_check_shapes``; None without TP or rows)."""
    K = o.backend
    cfg = K.default_config(e2.device, o.fp32_precision)
    need_de, need_dc = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = bias is not None and ctx.needs_input_grad[2]
    n, h = e2.shape
    v = c.shape[0]
    dev = e2.device
    f32 = torch.float32
    valid = t2 != o.ignore_index
    one = torch.ones((), dtype=f32, device=dev)
    if mask is not None:
        scale = mask
    else:
        scale = one / valid.sum().clamp(min=1) if o.reduction == "mean" else one
    g = torch.where(valid, scale, torch.zeros((), dtype=f32, device=dev))
    g = _nan_unless(~out_of_range(t2, v_global, o.ignore_index), g)  # the NaN lse's gradient
    row_stats = torch.empty((4, n), dtype=f32, device=dev)
    de = torch.empty((n, h), dtype=f32, device=dev) if need_de else None
    dc = (torch.zeros if n == 0 else torch.empty)((v, h), dtype=f32, device=dev) if need_dc else None
    db = torch.zeros((v,), dtype=f32, device=dev) if need_db else None
    rows = max(1, min(n, o.gif_rows or cfg.gif_rows))
    buf = K.saved_tiles(rows, v, torch.promote_types(e2.dtype, c.dtype), dev, cfg) if n else None
    first = None
    for i, r0 in enumerate(range(0, n, rows)):
        r1 = min(n, r0 + rows)
        tiles = K.rows_of(buf, r1 - r0)
        er, tr = e2[r0:r1], t2[r0:r1]
        stats = K.forward_stats(er, c, bias, tr, v_offset, o.softcap, o.smoothing > 0,
                                config=cfg, saved=tiles, invariant=o.invariant,
                                **({} if o.room is None else {"room": o.room}))
        (m_r, s_r, tgt_r, d_r), gathered = _merge(stats, v, o, shapes)
        first = gathered if i == 0 else first
        row_stats[:, r0:r1] = torch.stack([m_r, s_r, tgt_r, d_r])
        coef = _coef(m_r + torch.log(s_r), g[r0:r1], o, v_global, x_t=tgt_r)  # token_loss's lse
        dz = K.saved_dz_inplace(tiles, tr, v_offset, coef, o.softcap, cfg)
        if need_de:
            K.gemm_store(de[r0:r1], dz, c, cfg)
        if need_dc:
            (K.gemm_store if i == 0 else K.gemm_acc)(dc, dz.t(), er, cfg)
        if need_db:
            db += dz.sum(dim=0, dtype=f32)
    return row_stats.unbind(0), (de, dc, db), first


def loss(e, c, targets, bias, ignore_index, softcap, reduction, shift, return_lse, tp_group,
         sequence_parallel, label_smoothing, z_loss, impl, memory_budget,
         gradient_accumulation_fusion, loss_mask=None, fp32_precision="fp32",
         batch_invariant=False):
    """``functional.linear_cross_entropy`` (see there): check, options, backend and strategy,
    then the Function."""
    contract.check(e, c, targets, bias, ignore_index, softcap, reduction, shift, tp_group,
                   sequence_parallel, label_smoothing, z_loss, impl, memory_budget,
                   gradient_accumulation_fusion, loss_mask, fp32_precision, batch_invariant)
    ignore_index = int(ignore_index)
    targets = checks.widened_target(targets, ignore_index, "targets")
    if settings.flag(settings.CHECK_TARGETS, False):
        vocab = c.shape[0] * communication.world_size(tp_group)
        if compiling():  # the check reads the device: an op of the graph, run at run time
            targets = compiled_checks.checked_targets(targets, vocab, ignore_index)
        else:
            checks.check_target_range(targets, vocab, ignore_index)
    backend = backends.linear_backend(impl, e)
    sequence_parallel = bool(sequence_parallel)
    # the sequence dim of the targets: 0 with sequence parallelism ([s, b]), else the last
    seq_dim = 0 if sequence_parallel else targets.dim() - 1
    shift = int(shift)
    if shift:
        targets = _shifted(targets, seq_dim, shift, ignore_index)
        if loss_mask is not None:
            loss_mask = _shifted(loss_mask, seq_dim, shift, 0)
    softcap = float(softcap) if softcap else None
    smoothing = float(label_smoothing)
    strategy = choose_strategy(backend, e, c, bias, reduction, sequence_parallel, tp_group,
                               softcap, smoothing, memory_budget, gradient_accumulation_fusion,
                               masked=loss_mask is not None, invariant=batch_invariant)
    masked_gif = loss_mask is not None and strategy.name == "grad_in_forward"
    o = LinearLossOptions(
        ignore_index=ignore_index, softcap=softcap, reduction=reduction, group=tp_group,
        sequence_parallel=sequence_parallel and communication.world_size(tp_group) > 1,
        smoothing=smoothing, z_loss=float(z_loss), backend=backend,
        strategy=strategy.name, chunk_bytes=strategy.chunk_bytes,
        saved_cols=strategy.size if strategy.name == "saved" else None,
        gif_rows=strategy.size if strategy.name == "grad_in_forward" else None,
        room=strategy.room,
        main_grad=gradient_accumulation_fusion,
        masked=masked_gif, fp32_precision=fp32_precision, invariant=batch_invariant)
    mask = loss_mask.detach() if masked_gif else None  # (unused by the other strategies)
    if backend.TRACEABLE:  # plain PyTorch: Dynamo traces it into the graph
        out, lse = _LinearCrossEntropy.apply(e, c, bias, targets, o, mask)
    else:
        out, lse = untraced(_LinearCrossEntropy.apply, e, c, bias, targets, o, mask)
    if shift and reduction == "none":
        out = _kept(out, seq_dim, shift)
    if not return_lse:
        return out
    return out, (_kept(lse, seq_dim, shift) if shift else lse)
