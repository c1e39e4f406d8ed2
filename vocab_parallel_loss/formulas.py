"""The loss math in PyTorch, written once: merging per-shard statistics and the per-token loss.

Per token with global logits ``x``, target ``t``, label smoothing ``a``, z-loss ``z`` and global
vocabulary ``V``, row max ``m`` and ``s = sum_j exp(x_j - m)``::

    lse  = m + log s
    loss = (1 - a) ((m - x_t) + log s) + a (log s - sum_j (x_j - m) / V) + z lse^2

which is ``(1 - a) (lse - x_t) + a (lse - sum_j x_j / V) + z lse^2`` written so that the large
terms cancel first: ``m - x_t`` and ``x_j - m`` are exact for logits near a common offset (where
``lse - x_t`` would lose ``|lse| * 2^-24``), and the sum of differences from the max cannot
overflow where the sum of logits would (logits near 3e38).

Each vocabulary shard (or vocabulary split of one shard) contributes the statistics
``(m, s, x_t, d)``: its max, ``sum exp(x - m)``, the target logit (0 when the target is not in
the shard) and ``d = sum (x - m)`` over its columns (label smoothing only; ``-inf`` when a logit
is ``-inf``). The Triton kernels compute the same in-kernel; these functions serve the PyTorch
backends and the host-side merges. Arithmetic is fp32, or fp64 for float64 inputs
(``compute_dtype``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the statistics, the loss and the lse are computed in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def relative_sums(stats: torch.Tensor, v_part: int) -> torch.Tensor:
    """``(4, N)`` statistics whose last row is the plain sum of logits (the fused linear
    kernels' format) turned into ``sum (x - m)`` over ``v_part`` columns, in place."""
    m, sum_x = stats[0], stats[3]
    d = sum_x - v_part * m
    stats[3] = torch.where(m == float("-inf"), m, d)
    return stats


def ordered_sum(x: torch.Tensor) -> torch.Tensor:
    """``x.sum(dim=0)`` by a fixed pairwise tree of elementwise additions (halves added, an odd
    last part carried to the next level): each element's sum is rounded in an order that
    depends only on ``x.shape[0]``, on every device and whatever the other dims. A reduction
    kernel may pick its order from the whole shape (the rows of the statistics among it); the
    batch-invariant merges (``ordered=True`` below) take this one instead."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        head = x[:half] + x[half:2 * half]
        x = torch.cat([head, x[2 * half:]]) if x.shape[0] % 2 else head
    return x[0]


def merge_partial_stats(parts: torch.Tensor, ordered: bool = False):
    """Merge ``(S, 4, N)`` statistics of ``S`` disjoint column ranges whose last row is the plain
    sum of logits (the fused linear kernels' vocabulary splits) into ``(m, s, x_t, sum_x)``.

    A range whose logits are all ``-inf`` has ``m = -inf`` and ``s = 0``; it adds nothing (no
    ``-inf - -inf`` NaN). A NaN anywhere in a row makes that row's ``m`` and ``s`` NaN.
    ``ordered``: the sums over ranges by ``ordered_sum`` (batch-invariant statistics).
    """
    m_r, s_r = parts[:, 0], parts[:, 1]
    m = m_r.amax(dim=0)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    if ordered:
        s, t, sx = ordered_sum(torch.stack([s_r * torch.exp(m_r - m_safe), parts[:, 2],
                                            parts[:, 3]], dim=1))
    else:
        s, t, sx = (s_r * torch.exp(m_r - m_safe)).sum(dim=0), parts[:, 2].sum(dim=0), \
            parts[:, 3].sum(dim=0)
    m = torch.where(torch.isnan(s), s, m)
    return m, s, t, sx


def merge_stats(parts: torch.Tensor, v_part: int, ordered: bool = False):
    """``(m, s, x_t, d)`` of the whole row from ``(S, 4, N)`` statistics of ``S`` disjoint
    column ranges of ``v_part`` columns each.

    A range whose logits are all ``-inf`` has ``m = -inf`` and ``s = 0``; it adds nothing to
    ``s`` (no ``-inf - -inf`` NaN) and ``-inf`` to ``d``. A NaN anywhere in a row makes that
    row's ``m`` and ``s`` NaN. ``ordered``: the sums over ranges by ``ordered_sum``.
    """
    if parts.shape[0] == 1:
        return parts[0, 0], parts[0, 1], parts[0, 2], parts[0, 3]
    m_r, s_r, d_r = parts[:, 0], parts[:, 1], parts[:, 3]
    m = m_r.amax(dim=0)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    if ordered:
        s, t, d = ordered_sum(torch.stack([s_r * torch.exp(m_r - m_safe), parts[:, 2],
                                           d_r + v_part * (m_r - m_safe)], dim=1))
    else:
        s, t, d = (s_r * torch.exp(m_r - m_safe)).sum(dim=0), parts[:, 2].sum(dim=0), \
            (d_r + v_part * (m_r - m_safe)).sum(dim=0)
    m = torch.where(torch.isnan(s), s, m)
    return m, s, t, d


def out_of_range(target, vocab_size: int, ignore_index: int):
    """The tokens whose target is neither ``ignore_index`` nor in ``[0, vocab_size)``."""
    return (target != ignore_index) & ((target < 0) | (target >= vocab_size))


def token_loss(target, m, s, x_t, d, vocab_size: int, ignore_index: int, smoothing: float,
               z_loss: float):
    """Per-token loss (0 for ``ignore_index``, NaN for any other target outside
    ``[0, vocab_size)``) and lse from the row statistics. Returns ``(loss, lse, ignored,
    out_of_range)`` (the masks for callers that also mask the lse or count the tokens)."""
    log_s = torch.log(s)
    lse = m + log_s
    loss = (m - x_t) + log_s
    if smoothing > 0:
        loss = (1.0 - smoothing) * loss + smoothing * (log_s - d / vocab_size)
    if z_loss != 0:
        loss = loss + z_loss * lse * lse
    ignored = target == ignore_index
    bad = out_of_range(target, vocab_size, ignore_index)
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    loss = torch.where(ignored, torch.zeros_like(loss), loss)
    return loss, lse, ignored, bad


#: A log-probability below which ``exp`` is 0 in fp32 (below -104) and fp64 (below -746). The
#: log-prob backward clamps the entropy's ``x - lse`` there: no probability changes, and
#: ``gx * (x - lse)`` stays finite at a -inf logit (a masked column), where times ``p = 0`` it
#: would be ``0 * inf = NaN``.
LOG_UNDERFLOW = -1000.0


class LogprobArgs(NamedTuple):
    """The log-prob mode of the fused linear backends (``kernels.linear``,
    ``reference.linear.TorchBackend``): the logits are ``x = cap(scale * z) * inv_t`` with
    ``inv_t`` of one element or one per row (``1 / T``; fp32, or fp64 for float64 inputs), and
    the forward gives the five log-prob statistics (``merge_logprob_stats``), the argmax column
    among them when ``need_argmax``."""

    inv_t: torch.Tensor
    scale: float
    need_argmax: bool = False


def merge_logprob_stats(parts: torch.Tensor, ordered: bool = False):
    """Merge ``(S, 5, N)`` log-prob statistics of ``S`` disjoint column ranges in column order
    (``kernels/logprobs.py``: max ``m``, ``s = sum exp(x - m)``, ``w = sum exp(x - m) (x - m)``,
    target logit, column of the max) into the same five rows for the union of the ranges.

    ``w`` is carried relative to the max, so the entropy ``log s - w / s`` of a row with a large
    common offset loses nothing to cancellation. Ties of the max keep the first range's column.
    ``ordered``: the sums over ranges by ``ordered_sum`` (batch-invariant statistics).
    """
    if parts.shape[0] == 1:
        return tuple(parts[0])
    m_r, s_r, w_r = parts[:, 0], parts[:, 1], parts[:, 2]
    m = m_r.amax(dim=0)
    m_safe = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    alpha = torch.exp(m_r - m_safe)
    gap = torch.where(s_r > 0, (m_r - m_safe) * s_r, torch.zeros_like(s_r))
    if ordered:
        s, w, x_t = ordered_sum(torch.stack([alpha * s_r, alpha * (w_r + gap), parts[:, 3]],
                                            dim=1))
    else:
        s, w, x_t = (alpha * s_r).sum(dim=0), (alpha * (w_r + gap)).sum(dim=0), \
            parts[:, 3].sum(dim=0)
    first = torch.argmax((m_r == m).to(torch.float32), dim=0)  # the first range holding the max
    col = parts[:, 4].gather(0, first[None])[0]
    m = torch.where(torch.isnan(s), s, m)
    return m, s, w, x_t, col


def lse_low(m, s, lse):
    """What the rounded ``lse = m + log s`` lost: ``lse + low`` is the log-sum-exp to the
    precision of ``log s`` rather than of ``lse`` (Fast2Sum: exact when ``|m| >= log s``, as
    for logits near a large offset, where ``lse`` is off by up to half an ulp of the offset).
    Backward takes the softmax as ``exp((x - lse) - low)``, in which ``x - lse`` is exact near
    the max. 0 where ``lse`` is not finite (the row's result is NaN or -inf already)."""
    low = (m - lse) + torch.log(s)
    return torch.where(torch.isfinite(lse), low, torch.zeros_like(low))


def logprob_and_entropy(m, s, w, x_t):
    """``(log p_t, entropy, lse)`` from merged statistics: ``log p_t = (x_t - m) - log s`` and
    ``H = log s - w / s`` keep full precision when every logit carries a large offset."""
    log_s = torch.log(s)
    return (x_t - m) - log_s, log_s - w / s, m + log_s


def reduce_loss(loss, target, ignore_index: int, mean: bool):
    """``(total, count)``: the sum of the per-token ``loss``, or its mean over the non-ignored
    targets with their int64 count (None for the sum); 0, not NaN, when all are ignored."""
    if not mean:
        return loss.sum(), None
    count = (target != ignore_index).sum()
    return loss.sum() / count.clamp(min=1), count
