"""Triton kernels of the vocab-parallel cross entropy over materialized logits.

Nothing here knows about autograd or the TP group: each launcher takes a logits tensor viewed as
rows (see ``RowView``), plain numbers, and output buffers.

Row addressing. Logits are ``(..., V_local)`` with unit stride in the vocabulary; the leading
dims are collapsed by the caller into at most two levels ``(D0, D1)`` with strides ``(s0, s1)``,
so row ``n`` starts at ``(n // D1) * s0 + (n % D1) * s1``. That covers contiguous tensors,
Megatron's ``[s, b, v]`` transposed views and narrowed views without a copy. Offsets are 64-bit
(N x V above 2^31 elements is common at 256K vocabularies).

Numerics. All arithmetic is fp32 whatever the logits dtype; the exponentials use ``exp2`` on
pre-scaled values. The forward keeps a running max per 16-byte vector (see ``_row_stats``), so
each element costs one ``exp2``: a running max per element would cost two, at the H200's
special-function limit for bf16 at full HBM bandwidth, and a block-wide running max costs a
shared-memory reduction per block.

Reduced losses (``"mean"``/``"sum"``) on one shard need no per-token upstream gradient, so
``_ce_forward_grad_kernel`` writes their gradient during forward: each row is read twice by the
same program, the second time from L2, so HBM sees 4 B/element instead of 6. Backward then acts
only when the scalar upstream gradient is not 1, a test made on the device. A ``"mean"`` on this
path is three launches (count, fused kernel, reduction), chained on Hopper and later with
programmatic dependent launch (``_pdl``) so that the count and the launch gaps overlap the fused
kernel. With tensor parallelism the row's statistics need the collective first, so the two
passes stay.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .. import settings
from ..formulas import reduce_loss  # large reductions: the PyTorch ops
from .launch import launch, launch_memo, multiprocessors

# In the kernels, 1.4426950408889634 is log2(e) and 0.6931471805599453 is ln(2): written as
# literals because plain module-level floats are not visible inside @triton.jit on every version.


#: Backend capabilities (``backends.LogitsBackend``)
NAME = "triton"
FORMS_REDUCED_GRADIENT = True


@triton.jit
def _row_start(row, D1, s0, s1):
    r = row.to(tl.int64)
    return (r // D1) * s0 + (r % D1) * s1


@triton.jit
def _target_logit(x_row, t_local, V_local):
    """The row's logit at ``t_local`` in fp32, or 0 when the target is outside this shard (or
    the vocabulary): a masked scalar load, so such a target is never read."""
    in_shard = (t_local >= 0) & (t_local < V_local)
    x_t = tl.load(x_row + tl.where(in_shard, t_local, 0), mask=in_shard, other=0.0)
    return tl.where(in_shard, x_t.to(tl.float32), 0.0)


@triton.jit
def _load_masked(ptrs, mask, HINT: tl.constexpr):
    """A row block in fp32, -inf past the row's end, read with the L2 eviction policy ``HINT``."""
    return tl.load(ptrs, mask=mask, other=float("-inf"), eviction_policy=HINT).to(tl.float32)


@triton.jit
def _stats_step(x, m, s):
    """Fold one ``[BLOCK // VEC, VEC]`` tile into the running max and sum of exponentials; also
    returns ``x - max`` (the new running max of each tile row, 0 while it is -inf) and that max."""
    m_new = tl.maximum(m, tl.max(x, 1))
    # a tile row of only -inf keeps m_new = -inf: shift by 0 to avoid (-inf) - (-inf)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    diff = x - m_safe[:, None]
    p = tl.exp2(diff * 1.4426950408889634)
    return m_new, s * tl.exp2((m - m_safe) * 1.4426950408889634) + tl.sum(p, 1), diff, m_safe


@triton.jit
def _moved(m_old, m_safe, count):
    """What ``count`` earlier terms ``x - m_old`` of a tile row gain when its max becomes
    ``m_safe``: ``count (m_old - m_safe)``, <= 0 (-inf when they were all -inf), 0 for none."""
    return tl.where(count > 0, m_old - m_safe, 0.0) * count


@triton.jit
def _tile_row_columns(V_local, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """How many of the row's columns each tile row of a ``[BLOCK // VEC, VEC]`` tile reads over
    the whole row (the last block is cut at ``V_local``)."""
    rest = V_local % BLOCK - tl.arange(0, BLOCK // VEC) * VEC
    return ((V_local // BLOCK) * VEC + tl.minimum(tl.maximum(rest, 0), VEC)).to(tl.float32)


@triton.jit
def _row_stats_split(x_row, V_local, HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr,
                     VEC: tl.constexpr, HINT: tl.constexpr):
    """The loop of ``_row_stats`` over whole blocks without a mask, then the masked tail: fewer
    instructions per element, faster in the statistics pass (the fused kernel, whose rows up to
    64 KB are one or two blocks, is faster without it). Label smoothing's ``sum (x - max)`` is
    kept per element (each element's ``x - max`` is the exponential's argument already) and
    reduced once, at the end, plus a per-tile-row term for the moves of the running max: a
    per-block reduction of the loaded tile crashed Triton 3.6's thread-locality pass for fp32.
    Returns per tile row the max, the sum of exponentials and that sum of differences."""
    offs = tl.arange(0, BLOCK // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
    m = tl.full([BLOCK // VEC], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK // VEC], tl.float32)
    d = tl.zeros([BLOCK // VEC, VEC], tl.float32)
    moved = tl.zeros([BLOCK // VEC], tl.float32)
    n_full = V_local // BLOCK
    for b in range(0, n_full):
        x = tl.load(x_row + b * BLOCK + offs, eviction_policy=HINT).to(tl.float32)
        m_old = m
        m, s, diff, m_safe = _stats_step(x, m, s)
        if HAS_SMOOTHING:
            d += diff
            moved += _moved(m_old, m_safe, b * VEC)
    if n_full * BLOCK < V_local:
        idx = n_full * BLOCK + offs
        mask = idx < V_local
        x = _load_masked(x_row + idx, mask, HINT)
        m_old = m
        m, s, diff, m_safe = _stats_step(x, m, s)
        if HAS_SMOOTHING:
            d += tl.where(mask, diff, 0.0)
            moved += _moved(m_old, m_safe, n_full * VEC)
    return m, s, tl.sum(d, 1) + moved


@triton.jit
def _row_stats(x_row, V_local, t_local, HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr,
               VEC: tl.constexpr, HINT: tl.constexpr, SPLIT: tl.constexpr):
    """One pass over a row: (max, sum exp(x - max), target logit or 0, sum (x - max) or 0).

    A block of the row is read as a ``[BLOCK // VEC, VEC]`` tile whose ``VEC`` contiguous
    elements (16 bytes) sit in one thread, so the running max and sum are kept per tile row and
    the reductions over ``VEC`` stay inside a thread: no shared-memory round trip per block, and
    one ``exp2`` per element (plus one per ``VEC`` elements to rescale). Tile rows are merged once,
    at the end. ``HINT``: the L2 eviction policy of the reads (none in the statistics pass; the
    fused kernel, which reads the row twice, keeps it with ``evict_last``). ``SPLIT`` reads whole
    blocks without a mask and then the tail (``_row_stats_split``): on in the statistics pass,
    off in the fused kernel.

    Label smoothing's sum is taken relative to the running max of each tile row, moved along
    with it (``formulas.py``): every term is <= 0, so it overflows only where the smoothed loss
    does, and the differences are exact for logits near a common offset.
    """
    # the target logit first: its latency then overlaps the streaming loop instead of
    # trailing it (worth several % on short TP shards)
    x_t = _target_logit(x_row, t_local, V_local)
    if SPLIT:
        m, s, d = _row_stats_split(x_row, V_local, HAS_SMOOTHING, BLOCK, VEC, HINT)
    else:
        offs = tl.arange(0, BLOCK // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]
        m = tl.full([BLOCK // VEC], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK // VEC], tl.float32)
        d = tl.zeros([BLOCK // VEC], tl.float32)
        for start in range(0, V_local, BLOCK):
            idx = start + offs
            mask = idx < V_local
            x = _load_masked(x_row + idx, mask, HINT)
            m_old = m
            m, s, diff, m_safe = _stats_step(x, m, s)
            if HAS_SMOOTHING:  # every block before this one was whole: start // BLOCK * VEC
                d += tl.sum(tl.where(mask, diff, 0.0), 1) + _moved(m_old, m_safe,
                                                                    start // BLOCK * VEC)
    m_row = tl.max(m, 0)
    m_row_safe = tl.where(m_row == float("-inf"), 0.0, m_row)
    s_row = tl.sum(s * tl.exp2((m - m_row_safe) * 1.4426950408889634), 0)
    # NaN anywhere in the row: tl.max may drop it, the sum does not; make the max agree
    m_row = tl.where(s_row != s_row, s_row, m_row)
    if HAS_SMOOTHING:  # the tile rows' sums moved to the row's max
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        sx = tl.sum(d + _moved(m_safe, m_row_safe, _tile_row_columns(V_local, BLOCK, VEC)), 0)
    else:
        sx = 0.0
    return m_row, s_row, x_t, sx


@triton.jit
def _loss_from_stats(t, m, s, x_t, d, V_global, ignore_index, smoothing, z_loss,
                     HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr):
    """Per-token loss, the lse (NaN for an out-of-range target) and its low part (what the
    rounded lse lost, ``formulas.lse_low``: both are saved for backward) from the row's max
    ``m``, ``s = sum exp(x - m)``, target logit and ``d = sum (x - m)``; the large terms cancel
    first, as in ``formulas.token_loss``."""
    log_s = tl.log2(s) * 0.6931471805599453
    lse = m + log_s
    low = tl.where(tl.abs(lse) < float("inf"), (m - lse) + log_s, 0.0)
    loss = (m - x_t) + log_s
    if HAS_SMOOTHING:
        loss = (1.0 - smoothing) * loss + smoothing * (log_s - d / V_global)
    if HAS_Z:
        loss += z_loss * lse * lse
    ignored = t == ignore_index
    bad = (~ignored) & ((t < 0) | (t >= V_global))
    loss = tl.where(bad, float("nan"), loss)
    loss = tl.where(ignored, 0.0, loss)
    lse = tl.where(bad, float("nan"), lse)
    return loss, lse, low


@triton.jit
def _ce_forward_kernel(
    x_ptr, tgt_ptr, stats_ptr, loss_ptr, lse_ptr,
    N, V_local, D1, s0, s1, tgt_stride,
    vocab_start, V_global, ignore_index, smoothing, z_loss,
    FINALIZE: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + _row_start(row, D1, s0, s1)
    t = tl.load(tgt_ptr + row.to(tl.int64) * tgt_stride).to(tl.int64)
    # reads unhinted (evict_first was slower, evict_last the same), whole blocks then the tail
    m, s, x_t, sum_x = _row_stats(x_row, V_local, t - vocab_start, HAS_SMOOTHING, BLOCK, VEC, "",
                                  True)
    if FINALIZE:
        # one shard holds the whole vocabulary: the loss comes straight out
        loss, lse, low = _loss_from_stats(t, m, s, x_t, sum_x, V_global, ignore_index,
                                          smoothing, z_loss, HAS_SMOOTHING, HAS_Z)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)  # (2, N): the lse, then its low part
        tl.store(lse_ptr + N + row, low)
    else:
        # stats layout (4, N): max, sum-exp, target logit, sum (x - max); then this shard's
        # width, gathered with them (communication.check_shapes)
        tl.store(stats_ptr + row, m)
        tl.store(stats_ptr + N + row, s)
        tl.store(stats_ptr + 2 * N + row, x_t)
        tl.store(stats_ptr + 3 * N + row, sum_x)
        if row == 0:
            tl.store(stats_ptr + 4 * N, V_local * 1.0)


@triton.jit
def _ce_merge_kernel(
    stats_ptr, tgt_ptr, loss_ptr, lse_ptr,
    N, WORLD, RANK_STRIDE, tgt_stride, V_global, ignore_index, smoothing, z_loss,
    HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """Merge the all-gathered stats into the full-vocabulary loss: per rank, ``(4, N)`` stats and
    then the rank's shard width (``RANK_STRIDE`` floats: ``communication.stats_size``); shards
    of unequal width give NaN (every rank sees the same widths)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ranks = tl.arange(0, BLOCK_W)
    row_ok = rows < N
    mask = (ranks[:, None] < WORLD) & row_ok[None, :]
    widths = tl.load(stats_ptr + ranks.to(tl.int64) * RANK_STRIDE + 4 * N, mask=ranks < WORLD,
                     other=0.0)
    unequal = tl.sum(((ranks < WORLD) & (widths != V_global // WORLD)).to(tl.int32), 0) > 0
    base = stats_ptr + ranks[:, None].to(tl.int64) * RANK_STRIDE + rows[None, :]
    m_r = tl.load(base, mask=mask, other=float("-inf"))
    s_r = tl.load(base + N, mask=mask, other=0.0)
    x_t = tl.sum(tl.load(base + 2 * N, mask=mask, other=0.0), 0)
    m = tl.max(m_r, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_r * tl.exp2((m_r - m_safe[None, :]) * 1.4426950408889634), 0)
    if HAS_SMOOTHING:  # each rank's sum (x - m_r) moved to the global max
        d_r = tl.load(base + 3 * N, mask=mask, other=0.0)
        v_part = (V_global // WORLD).to(tl.float32)
        d = tl.sum(tl.where(mask, d_r + v_part * (m_r - m_safe[None, :]), 0.0), 0)
    else:
        d = 0.0
    m = tl.where(s != s, s, m)
    m = tl.where(unequal, float("nan"), m)
    t = tl.load(tgt_ptr + rows.to(tl.int64) * tgt_stride, mask=row_ok, other=0).to(tl.int64)
    loss, lse, low = _loss_from_stats(t, m, s, x_t, d, V_global, ignore_index, smoothing,
                                      z_loss, HAS_SMOOTHING, HAS_Z)
    tl.store(loss_ptr + rows, loss, mask=row_ok)
    tl.store(lse_ptr + rows, lse, mask=row_ok)  # (2, N): the lse, then its low part
    tl.store(lse_ptr + N + rows, low, mask=row_ok)


@triton.jit
def _ce_reduce_kernel(loss_ptr, tgt_ptr, out_ptr, count_ptr, N, tgt_stride, ignore_index,
                      MEAN: tl.constexpr, COUNTED: tl.constexpr, BLOCK: tl.constexpr,
                      GDC: tl.constexpr = False):
    """The summed loss, or its mean over non-ignored tokens (0 when none) and that count.

    One program in a fixed order: deterministic, and one launch instead of the five PyTorch ops
    (count, two sums, clamp, divide) that cost ~8 us of host time each. ``GDC``: launched
    before the kernel that writes the loss has finished (``_pdl``); it waits for it first.
    """
    if GDC:
        tl.extra.cuda.gdc_wait()
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        idx = start + offs
        acc += tl.load(loss_ptr + idx, mask=idx < N, other=0.0)
    total = tl.sum(acc, 0)
    if MEAN:
        if COUNTED:  # the count is in count_ptr already
            c = tl.load(count_ptr)
        else:
            c = _count_kept(tgt_ptr, N, tgt_stride, ignore_index, BLOCK)
            tl.store(count_ptr, c)
        total = total / tl.maximum(c.to(tl.float32), 1.0)
    tl.store(out_ptr, total)


@triton.jit
def _softmax_base(lse, low):
    """``(lse2, scale)`` such that ``scale * exp2(fma(x, log2 e, -lse2))`` is
    ``exp(x - (lse + low))``, the softmax from the lse and its low part (``formulas.lse_low``).

    ``lse2`` is the base-2 lse rounded to fp32, whose error (up to half an ulp: 5e-4 at 1e4)
    would be every ``p``'s relative error, as the rounding of ``lse`` itself would. Both are
    taken into the per-row ``scale``: ``lse2 - lse log2 e`` exactly (the product's rounding, an
    fma) less ``low log2 e``. Per element it stays one fma and one ``exp2``, whose argument is
    rounded relative to ``x - lse`` (the fma rounds once), not to ``lse``."""
    lse2 = lse * 1.4426950408889634
    return lse2, tl.exp2(tl.fma(lse, -1.4426950408889634, lse2) - low * 1.4426950408889634)


@triton.jit
def _row_grad(x_row, dx_row, V_local, t_local, lse2, coef, target_coef, uniform, valid,
              HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, LOAD_HINT: tl.constexpr):
    """dx_j = coef * softmax_j - target_coef [j == t] - uniform over one row, rounded once;
    ``lse2`` and the scale in ``coef`` from ``_softmax_base``.

    ``LOAD_HINT``: the L2 eviction policy of the reads (``backward_config``); the writes are
    unhinted (``evict_first`` on them was slower)."""
    cols = tl.arange(0, BLOCK)
    for start in range(0, V_local, BLOCK):
        idx = start + cols
        mask = idx < V_local
        x = tl.load(x_row + idx, mask=mask, other=0.0, eviction_policy=LOAD_HINT).to(tl.float32)
        p = tl.exp2(tl.fma(x, 1.4426950408889634, -lse2))
        if HAS_SMOOTHING:  # the uniform term folded into the selected constant: one FMA
            dx = coef * p - tl.where(idx == t_local, target_coef + uniform, uniform)
        else:
            dx = coef * p - tl.where(idx == t_local, target_coef, 0.0)
        dx = tl.where(valid, dx, 0.0)
        tl.store(dx_row + idx, dx.to(dx_row.dtype.element_ty), mask=mask)


@triton.jit
def _row_grad_lean(x_row, dx_row, V_local, t_local, x_t, lse2, coef, target_coef, uniform, valid,
                   ref, HAS_SMOOTHING: tl.constexpr, BLOCK: tl.constexpr, SUM_X: tl.constexpr,
                   STORE_HINT: tl.constexpr):
    """``_row_grad`` for the fused kernel, with fewer instructions per element: that kernel does
    two passes of arithmetic per 4 B of traffic and was instruction-bound with the plain loop.
    Walks the row from its end, so the second read meets first the blocks the first read left
    in L2 last (the tail block first, then whole blocks without a mask); an ignored row takes a
    branch that stores zeros; the target column's term is not tested per element but written
    once at the end, from ``x_t`` (the same value as the column's element), after a barrier
    orders it behind the row's stores. (The backward kernel keeps ``_row_grad``: it is not
    instruction-bound, and this loop was slower there.)

    The reads are ``evict_first`` (the row is not read again); ``STORE_HINT``: the L2 eviction
    policy of the gradient's stores (``fused_config``). ``SUM_X``: also returns
    ``sum (x - ref)`` over the row (label smoothing's loss needs it, ``ref`` the row's max:
    ``formulas.py``), a subtract and an add per element into a per-lane accumulator, with no
    select; an ignored row returns 0."""
    cols = tl.arange(0, BLOCK)
    n_full = V_local // BLOCK
    tail = n_full * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    if valid:
        if tail < V_local:
            idx = tail + cols
            mask = idx < V_local
            # past the row's end: ref itself (a logit of the row, so exact in its dtype), which
            # adds 0 to the sum (a select here cost 48 registers more: ptxas 13.4, sm_90a)
            x = tl.load(x_row + idx, mask=mask, other=ref if SUM_X else 0.0,
                        eviction_policy="evict_first").to(tl.float32)
            dx = coef * tl.exp2(tl.fma(x, 1.4426950408889634, -lse2))
            if HAS_SMOOTHING:
                dx -= uniform
            if SUM_X:
                acc += x - ref
            tl.store(dx_row + idx, dx.to(dx_row.dtype.element_ty), mask=mask,
                     eviction_policy=STORE_HINT)
        for i in range(0, n_full):
            idx = (n_full - 1 - i) * BLOCK + cols
            x = tl.load(x_row + idx, eviction_policy="evict_first").to(tl.float32)
            dx = coef * tl.exp2(tl.fma(x, 1.4426950408889634, -lse2))
            if HAS_SMOOTHING:
                dx -= uniform
            if SUM_X:
                acc += x - ref
            tl.store(dx_row + idx, dx.to(dx_row.dtype.element_ty), eviction_policy=STORE_HINT)
        in_shard = (t_local >= 0) & (t_local < V_local)
        tl.debug_barrier()  # every thread's store of the target column is behind this one
        # the same rounding as ``_row_grad``'s target column (the two paths agree bitwise)
        if HAS_SMOOTHING:
            dx_t = coef * tl.exp2(tl.fma(x_t, 1.4426950408889634, -lse2)) - (target_coef + uniform)
        else:
            dx_t = coef * tl.exp2(tl.fma(x_t, 1.4426950408889634, -lse2)) - target_coef
        tl.store(dx_row + tl.where(in_shard, t_local, 0), dx_t.to(dx_row.dtype.element_ty),
                 mask=in_shard)
    else:
        zero = tl.zeros([BLOCK], dx_row.dtype.element_ty)
        for start in range(0, V_local, BLOCK):
            idx = start + cols
            tl.store(dx_row + idx, zero, mask=idx < V_local)
    return tl.sum(acc, 0)


@triton.jit
def _grad_coefs(g, lse, scale, valid, smoothing, z_loss, V_global, HAS_Z: tl.constexpr):
    """(coef, target_coef, uniform) of ``_row_grad`` for upstream gradient ``g``; ``scale``
    from ``_softmax_base``, taken into ``coef``."""
    coef = g
    if HAS_Z:
        coef = g * (1.0 + 2.0 * z_loss * tl.where(valid, lse, 0.0))
    return coef * scale, g * (1.0 - smoothing), g * smoothing / V_global


@triton.jit
def _ce_backward_kernel(
    x_ptr, dx_ptr, tgt_ptr, lse_ptr, dloss_ptr, count_ptr,
    N, V_local, D1, s0, s1, d0, d1, tgt_stride, dloss_stride,
    vocab_start, V_global, ignore_index, smoothing, z_loss,
    MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, BLOCK: tl.constexpr,
    UNLESS_UNIT: tl.constexpr = False, LOAD_HINT: tl.constexpr = "",
):
    """dx_j = g * (softmax_j * (1 + 2 z lse) - (1 - a) [j == t] - a / V), rounded once.

    ``UNLESS_UNIT``: ``dx`` already holds the gradient for an upstream gradient of 1 (written by
    ``_ce_forward_grad_kernel``); rows are rewritten only when the scalar upstream gradient is
    not 1, a test on the device (no host sync). The grid is then a few programs per
    multiprocessor looping over rows: with g == 1 they exit at once (a program per row costs
    ~1 us per 1000 rows just to start and exit).
    """
    if UNLESS_UNIT:
        g = tl.load(dloss_ptr).to(tl.float32)
        if g != 1.0:
            pid, n_prog = tl.program_id(0), tl.num_programs(0)
            for i in range(0, tl.cdiv(N - pid, n_prog)):
                _backward_row(pid + i * n_prog, g, x_ptr, dx_ptr, tgt_ptr, lse_ptr, count_ptr,
                              N, V_local, D1, s0, s1, d0, d1, tgt_stride, vocab_start, V_global,
                              ignore_index, smoothing, z_loss, MEAN, HAS_SMOOTHING, HAS_Z, BLOCK,
                              LOAD_HINT)
    else:
        row = tl.program_id(0)
        g = tl.load(dloss_ptr + row.to(tl.int64) * dloss_stride).to(tl.float32)
        _backward_row(row, g, x_ptr, dx_ptr, tgt_ptr, lse_ptr, count_ptr, N, V_local, D1, s0,
                      s1, d0, d1, tgt_stride, vocab_start, V_global, ignore_index, smoothing,
                      z_loss, MEAN, HAS_SMOOTHING, HAS_Z, BLOCK, LOAD_HINT)


@triton.jit
def _backward_row(row, g, x_ptr, dx_ptr, tgt_ptr, lse_ptr, count_ptr, N, V_local, D1, s0, s1,
                  d0, d1, tgt_stride, vocab_start, V_global, ignore_index, smoothing, z_loss,
                  MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr,
                  BLOCK: tl.constexpr, LOAD_HINT: tl.constexpr):
    x_row = x_ptr + _row_start(row, D1, s0, s1)
    dx_row = dx_ptr + _row_start(row, D1, d0, d1)
    t = tl.load(tgt_ptr + row.to(tl.int64) * tgt_stride).to(tl.int64)
    t_local = t - vocab_start
    valid = t != ignore_index
    if MEAN:
        g = g / tl.maximum(tl.load(count_ptr).to(tl.float32), 1.0)
    # (2, N): the lse, then its low part
    lse = tl.where(valid, tl.load(lse_ptr + row), 0.0)
    lse2, scale = _softmax_base(lse, tl.where(valid, tl.load(lse_ptr + N + row), 0.0))
    coef, target_coef, uniform = _grad_coefs(g, lse, scale, valid, smoothing, z_loss, V_global,
                                             HAS_Z)
    _row_grad(x_row, dx_row, V_local, t_local, lse2, coef, target_coef, uniform, valid,
              HAS_SMOOTHING, BLOCK, LOAD_HINT)


@triton.jit
def _count_kept(tgt_ptr, N, tgt_stride, ignore_index, BLOCK: tl.constexpr):
    """The int64 count of targets that are not ``ignore_index`` (one program, fixed order)."""
    offs = tl.arange(0, BLOCK)
    cnt = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        idx = start + offs
        ok = idx < N
        t = tl.load(tgt_ptr + idx.to(tl.int64) * tgt_stride, mask=ok, other=ignore_index)
        cnt += (ok & (t != ignore_index)).to(tl.int32)
    return tl.sum(cnt, 0).to(tl.int64)


@triton.jit
def _ce_count_kernel(tgt_ptr, count_ptr, N, tgt_stride, ignore_index, BLOCK: tl.constexpr,
                     GDC: tl.constexpr = False):
    if GDC:  # the fused kernel may start now (programmatic dependent launch, see ``_pdl``)
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(count_ptr, _count_kept(tgt_ptr, N, tgt_stride, ignore_index, BLOCK))


@triton.jit
def _ce_forward_grad_kernel(
    x_ptr, dx_ptr, tgt_ptr, loss_ptr, lse_ptr, count_ptr,
    N, V_local, D1, s0, s1, d0, d1, tgt_stride,
    vocab_start, V_global, ignore_index, smoothing, z_loss,
    MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr, BLOCK: tl.constexpr,
    VEC: tl.constexpr, GRAD_BLOCK: tl.constexpr, GDC: tl.constexpr = False,
    SUM_IN_GRAD: tl.constexpr = False, STORE_HINT: tl.constexpr = "",
):
    """Loss, lse and the gradient for a unit upstream gradient of a reduced loss, in one kernel.

    One shard holds the whole vocabulary. Each row is read twice, the second time (moments
    later, by the same program) mostly from L2, so HBM sees 2 B read + 2 B written per element
    against 6 B for the forward-then-backward passes. The first read keeps the row in L2
    (``evict_last``), the second lets it go (``evict_first``).

    The launch is a program per row (``forward_grad``), so the rows in flight, and with them the
    L2 footprint, are bounded by residency. The body is a loop over rows strided by the grid, so
    each program's loop runs once: the configs were measured with this compiled code, and the
    kernel's speed moves with its register allocation (docs/design.md, section 5).

    ``GDC``: launched while the count kernel still runs (``_pdl``); the first read of a row
    overlaps it, and the count is read only after ``gdc_wait``. The grid is never larger than
    N, so every program waits at least once: this kernel never ends before the count kernel.

    ``SUM_IN_GRAD`` (label smoothing): the sum of logits is taken in the second pass
    (``_row_grad_lean``'s ``SUM_X``) rather than the first, so the first pass is the plain one,
    and the loss is stored after the second.
    """
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    for i in range(0, tl.cdiv(N - pid, n_prog)):
        row = pid + i * n_prog
        x_row = x_ptr + _row_start(row, D1, s0, s1)
        t = tl.load(tgt_ptr + row.to(tl.int64) * tgt_stride).to(tl.int64)
        t_local = t - vocab_start
        if SUM_IN_GRAD:  # the lse now (NaN for an out-of-range target), the loss after pass 2
            m, s, x_t, _ = _row_stats(x_row, V_local, t_local, False, BLOCK, VEC, "evict_last",
                                      False)
            _, lse, low = _loss_from_stats(t, m, s, x_t, 0.0, V_global, ignore_index,
                                           smoothing, z_loss, False, HAS_Z)
        else:
            m, s, x_t, sum_x = _row_stats(x_row, V_local, t_local, HAS_SMOOTHING, BLOCK, VEC,
                                          "evict_last", False)
            loss, lse, low = _loss_from_stats(t, m, s, x_t, sum_x, V_global, ignore_index,
                                              smoothing, z_loss, HAS_SMOOTHING, HAS_Z)
            tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)  # (2, N): the lse, then its low part
        tl.store(lse_ptr + N + row, low)
        g = 1.0
        if MEAN:
            if GDC:  # the count kernel has finished and its store is visible
                tl.extra.cuda.gdc_wait()
            g = 1.0 / tl.maximum(tl.load(count_ptr).to(tl.float32), 1.0)
        valid = t != ignore_index
        lse = tl.where(valid, lse, 0.0)
        lse2, scale = _softmax_base(lse, tl.where(valid, low, 0.0))
        coef, target_coef, uniform = _grad_coefs(g, lse, scale, valid, smoothing, z_loss,
                                                 V_global, HAS_Z)
        sum_x = _row_grad_lean(x_row, dx_ptr + _row_start(row, D1, d0, d1), V_local, t_local,
                               x_t, lse2, coef, target_coef, uniform, valid,
                               tl.where(m == float("-inf"), 0.0, m), HAS_SMOOTHING, GRAD_BLOCK,
                               SUM_IN_GRAD and HAS_SMOOTHING, STORE_HINT)
        if SUM_IN_GRAD:
            loss, _, _ = _loss_from_stats(t, m, s, x_t, sum_x, V_global, ignore_index,
                                          smoothing, z_loss, HAS_SMOOTHING, HAS_Z)
            tl.store(loss_ptr + row, loss)


def _block(v_local: int, cap: int) -> int:
    return max(16, min(cap, 1 << (v_local - 1).bit_length()))  # triton.next_power_of_2


# The configs were chosen by sweeps on the H200 (docs/design.md, section 5, has the figures).
# They are cached (one dict per shape and dtype) because they are read on every launch; the dicts
# are only unpacked into launches, never changed.
@functools.lru_cache(maxsize=256)
def forward_config(v_local: int, dtype: torch.dtype) -> dict:
    """Launch parameters of the statistics pass."""
    # 2048-element blocks of 16-byte vectors, 4 warps: within 3% of the best on every shape
    vec = 16 // dtype.itemsize
    return dict(BLOCK=max(vec, _block(v_local, 2048)), VEC=vec, num_warps=4)


@functools.lru_cache(maxsize=256)
def backward_config(v_local: int, dtype: torch.dtype, smoothing: bool = False) -> dict:
    """Launch parameters of the gradient pass; ``smoothing``: label smoothing is on."""
    # blocks of 8K-16K elements, the sweeps' best. 2-byte logits are read evict_last although
    # they are not read again: faster, into a new buffer and in place (why is not known); on
    # fp32 reads the hint was slower
    hint = dict(LOAD_HINT="evict_last" if dtype.itemsize == 2 else "")
    if v_local > 32768:
        return dict(BLOCK=8192, num_warps=32, **hint)
    if v_local > 16384:
        # 32 warps beat 8, except for label smoothing on 2-byte logits: its code was slower at
        # 32 warps and as fast as plain at 8 (why is not known; fp32 was not measured)
        warps = 8 if smoothing and dtype.itemsize == 2 else 32
        return dict(BLOCK=16384, num_warps=warps, **hint)
    return dict(BLOCK=_block(v_local, 16384), num_warps=8 if v_local > 4096 else 4, **hint)


def forward(view, target, opts, stats=None, loss=None, lse=None, memo=None):
    """Per-row statistics into ``stats``, or, when ``stats`` is None, loss and lse directly.

    ``stats`` is the flat send buffer of ``communication.stats_size(4, N)`` floats: the ``(4, N)``
    statistics, then this shard's width (the shapes gathered with them). ``lse`` is a contiguous
    ``(2, N)`` buffer: the lse, then its low part (``formulas.lse_low``), both saved for
    backward; ``loss`` is ``(N,)``.

    ``view`` is a ``RowView`` of the logits, ``target`` the flat (N,) targets, ``opts`` the
    ``LossOptions``; ``memo`` (a dict, or None) remembers the launch for the next call with the
    same shapes (``launch.launch_memo``).
    """
    n, x = target.numel(), view.tensor
    v_local = x.shape[-1]
    finalize = stats is None
    out = loss if finalize else stats  # unused pointers get a real tensor: None has no key
    args = (x, target, out, out if finalize else stats, lse if finalize else stats,
            n, v_local, view.D1, view.s0, view.s1, target.stride(0), *opts)

    def kwargs():  # a function of the slot, v_local, the dtype and opts: see launch_memo
        return dict(FINALIZE=finalize, HAS_SMOOTHING=opts.smoothing > 0, HAS_Z=opts.z_loss != 0,
                    **forward_config(v_local, x.dtype))

    if memo is None:
        launch(_ce_forward_kernel, (n,), *args, **kwargs())
    else:
        launch_memo(memo, ("forward", finalize), _ce_forward_kernel, (n,), args, kwargs)


def merge(gathered, target, loss, lse, opts):
    """Loss (N,) and lse (2, N: with its low part, as ``forward``'s) from ``gathered``, the
    ``(world, stats_size(4, N))`` all-gather of every rank's ``forward`` statistics
    (``communication.gather_stats``)."""
    world, n = gathered.shape[0], target.numel()
    _, vocab_size, ignore_index, smoothing, z_loss = opts
    block_n = 128
    launch(
        _ce_merge_kernel, (-(-n // block_n),),
        gathered, target, loss, lse, n, world, gathered.stride(0), target.stride(0), vocab_size,
        ignore_index, smoothing, z_loss, HAS_SMOOTHING=smoothing > 0, HAS_Z=z_loss != 0,
        BLOCK_N=block_n, BLOCK_W=max(2, 1 << (world - 1).bit_length()), num_warps=4,
    )


#: Up to this many tokens the reduction is one single-program launch (host time: what matters
#: when the kernels are short); above it, PyTorch's multi-block reductions (GPU time: one
#: program streams ~100-200 GB/s, so 1M tokens would take ~0.1 ms).
REDUCE_ONE_PROGRAM_MAX = 16384


def reduce(loss, target, ignore_index, mean, memo=None, count=None, chained=False):
    """``(total, count)``: fp32 scalars sum or mean of ``loss`` (N,), and for ``mean`` the int64
    count of non-ignored targets (None otherwise); a ``count`` given (``count()``) is used.
    ``chained``: launched on the kernel before it with programmatic dependent launch (``_pdl``);
    that kernel must not finish before the ones it depends on."""
    counted = count is not None
    if loss.numel() > REDUCE_ONE_PROGRAM_MAX:
        if counted:  # the PyTorch ops
            return loss.sum() / count.clamp(min=1), count
        return reduce_loss(loss, target, ignore_index, mean)
    out = torch.empty((), dtype=torch.float32, device=loss.device)
    if mean and not counted:
        count = torch.empty((), dtype=torch.int64, device=loss.device)
    args = (loss, target, out, count if mean else out, loss.numel(), target.stride(0),
            ignore_index)

    chained = chained and _pdl(loss.device)

    def kwargs():
        return dict(MEAN=mean, COUNTED=counted, BLOCK=4096, num_warps=16, **_chain(chained))

    if memo is None:
        launch(_ce_reduce_kernel, (1,), *args, **kwargs())
    else:
        launch_memo(memo, ("reduce", mean, counted, chained), _ce_reduce_kernel, (1,), args,
                    kwargs)
    return out, count


#: programs per multiprocessor of the backward that acts only for an upstream gradient != 1
UNLESS_UNIT_PER_SM = 8


def backward(view, dview, target, lse, dloss, count, opts, memo=None, unless_unit=False):
    """Write the logits gradient into ``dview`` (which may be ``view``: in-place backward).

    ``lse`` is the ``(2, N)`` lse and low part that the forward wrote. ``dloss`` is the
    per-token upstream gradient (any stride, 0 for a broadcast scalar); ``count`` (a device
    scalar) divides it for a mean reduction, or is None. ``unless_unit``:
    ``dview`` holds the gradient for a unit scalar ``dloss`` already (``forward_grad``); it is
    rewritten only when ``dloss`` is not 1.
    """
    n, x = target.numel(), view.tensor
    v_local = x.shape[-1]
    mean = count is not None
    args = (x, dview.tensor, target, lse, dloss, count if mean else lse,
            n, v_local, view.D1, view.s0, view.s1, dview.s0, dview.s1, target.stride(0),
            dloss.stride(0) if dloss.dim() else 0, *opts)
    grid = (min(n, UNLESS_UNIT_PER_SM * multiprocessors(x.device)),) if unless_unit else (n,)

    def kwargs():
        return dict(MEAN=mean, HAS_SMOOTHING=opts.smoothing > 0, HAS_Z=opts.z_loss != 0,
                    UNLESS_UNIT=unless_unit,
                    **backward_config(v_local, x.dtype, opts.smoothing > 0))

    if memo is None:
        launch(_ce_backward_kernel, grid, *args, **kwargs())
    else:
        launch_memo(memo, ("backward", mean, unless_unit), _ce_backward_kernel, grid, args,
                    kwargs)


# --------------------------------------------------------------- fused path of reduced losses
@functools.lru_cache(maxsize=256)
def fused_config(v_local: int, dtype: torch.dtype, smoothing: bool = False,
                 inplace: bool = False) -> dict:
    """Launch parameters of ``_ce_forward_grad_kernel``; ``inplace``: the gradient is written
    over the logits.

    The rows in flight must stay few enough that a row is still in L2 when its program reads
    it the second time (rows in flight x row bytes well under the 50 MB L2). The launch is a
    program per row (fixed grids looping over rows were slower), so what bounds them is
    residency: the registers ptxas gives a config.
    """
    # many loads in flight per thread: 8 warps reading 16K-element blocks up to 64 KB rows;
    # longer rows take more warps and shorter blocks (past 128 KB the rows in flight outgrow
    # the L2). Whole blocks without a mask (the statistics pass's SPLIT) were slower here.
    vec = 16 // dtype.itemsize
    row_bytes = v_local * dtype.itemsize
    if row_bytes <= 65536:
        block, grad_block, warps = 16384, 16384, 8
    elif row_bytes <= 131072:
        block, grad_block, warps = 8192, 16384, 16
    else:
        block, grad_block, warps = 8192, 8192, 32
    # Label smoothing's sum of logits: taken in the second pass (SUM_IN_GRAD) for 32-64 KB
    # rows, where the plain config summing in the first pass was slow (why is not known: it
    # does not spill); in the first pass with 4K / 8K blocks elsewhere up to 128 KB, where the
    # second-pass sum was slower; longer rows keep their plain config.
    sum_in_grad = smoothing and 32768 < row_bytes <= 65536
    if sum_in_grad:
        block, grad_block, warps = 16384, 8192, 8
    elif smoothing and row_bytes <= 131072:
        block, grad_block, warps = 4096, 8192, 8 if row_bytes <= 65536 else 16
    # the gradient's stores evict_first: faster, except in place on rows up to 32 KB
    store = "" if inplace and row_bytes <= 32768 else "evict_first"
    return dict(BLOCK=max(vec, _block(v_local, block)), VEC=vec,
                GRAD_BLOCK=_block(v_local, grad_block), num_warps=warps,
                SUM_IN_GRAD=sum_in_grad, STORE_HINT=store)


#: Up to this many tokens ``count`` is one single-program launch, else PyTorch's reduction
COUNT_ONE_PROGRAM_MAX = REDUCE_ONE_PROGRAM_MAX * 4


def _counts_in_one_program(n: int) -> bool:
    """Whether ``count`` of ``n`` targets launches our kernel (a fused kernel may be chained to
    it, ``_pdl``), rather than PyTorch's reduction."""
    return n <= COUNT_ONE_PROGRAM_MAX


#: ``VPL_PDL=0`` turns programmatic dependent launch off (``_pdl``)
PDL_ENV = settings.PDL


@functools.lru_cache(maxsize=8)
def _pdl(device: torch.device) -> bool:
    """Whether the fused path of a reduced loss chains its three launches with programmatic
    dependent launch (Hopper and later): the count kernel lets the fused kernel start at once,
    and the fused kernel waits for the count only when it needs it, after a row's first read;
    the reduction is launched before the fused kernel has finished and waits for it first. Two
    launch gaps then overlap work (a few us off a mean's forward on the H200).

    Why it is safe: before its wait the fused kernel reads the logits and targets, which the
    kernels before the count kernel had finished (the count kernel itself is launched the usual
    way), and writes the loss, lse and gradient, memory the count kernel never touches (it reads
    the targets and writes the count, both held by the caller). The reduction does nothing
    before its wait. Only our own count kernel is chained to: after PyTorch's reduction (more
    than ``COUNT_ONE_PROGRAM_MAX`` tokens) a buffer it freed could be handed to the fused kernel.
    """
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    if not settings.flag(PDL_ENV, True) or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _chain(on: bool) -> dict:
    """The keywords of a kernel launched with programmatic dependent launch (none when off, so
    Triton releases without the option still launch)."""
    return dict(GDC=True, launch_pdl=True) if on else {}


def count(target, ignore_index, memo=None):
    """The int64 device scalar count of targets that are not ``ignore_index``."""
    n = target.numel()
    if not _counts_in_one_program(n):  # one program would stream too long
        return (target != ignore_index).sum()
    out = torch.empty((), dtype=torch.int64, device=target.device)
    args = (target, out, n, target.stride(0), ignore_index)
    # lets a chained fused kernel start (an early trigger changes nothing for other launches)
    trigger = dict(GDC=True) if _pdl(target.device) else {}

    def kwargs():
        return dict(BLOCK=4096, num_warps=16, **trigger)

    if memo is None:
        launch(_ce_count_kernel, (1,), *args, **kwargs())
    else:
        launch_memo(memo, ("count",), _ce_count_kernel, (1,), args, kwargs)
    return out


def forward_grad(view, dview, target, loss, lse, count, opts, memo=None):
    """Per-token loss and lse (``(2, N)``, as ``forward``'s), and into ``dview`` the gradient of
    the sum (``count`` None) or of the mean over ``count`` tokens, for an upstream gradient of
    1: the fused path of a reduced loss when one shard holds the whole vocabulary."""
    n, x = target.numel(), view.tensor
    v_local = x.shape[-1]
    mean = count is not None
    cfg = fused_config(v_local, x.dtype, opts.smoothing > 0, dview.tensor is x)
    grid = (n,)  # a program per row
    args = (x, dview.tensor, target, loss, lse, count if mean else lse,
            n, v_local, view.D1, view.s0, view.s1, dview.s0, dview.s1, target.stride(0), *opts)

    # chained to the count kernel only (``_pdl``: not after PyTorch's count)
    chain = _chain(mean and _counts_in_one_program(n) and _pdl(x.device))

    def kwargs():
        return dict(MEAN=mean, HAS_SMOOTHING=opts.smoothing > 0, HAS_Z=opts.z_loss != 0, **cfg,
                    **chain)

    if memo is None:
        launch(_ce_forward_grad_kernel, grid, *args, **kwargs())
    else:
        launch_memo(memo, ("forward_grad", mean), _ce_forward_grad_kernel, grid, args, kwargs)
