"""One loss step over a tensor input, measured: forward and backward timed apart, and (one GPU)
the peak memory and the error against a reference.

``measure_budgeted``: the one-GPU method (a first call, then memory and error on a fresh leaf,
a warm-up that sizes the number of timed reps to a time budget, L2 flushed before each rep).
``measure_aligned``: the multi-rank method (a fixed number of reps, the input restored and every
rank aligned before each).
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

import torch

from .errors import max_abs_diff
from .timing import Device, fwd_bwd_medians, timed_fwd_bwd


def measure_budgeted(dev: Device, loss_fn: Callable[[torch.Tensor], torch.Tensor],
                     backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                     inp: torch.Tensor, ref: Tuple[torch.Tensor, torch.Tensor], warmup: int,
                     min_reps: int, max_reps: int, budget_s: float) -> dict:
    """``loss_fn(x)`` then ``backward(loss, x)`` (the gradient of x) on leaf copies of ``inp``.
    Returns fwd_ms, bwd_ms, total_ms (medians), reps, peak_extra_bytes (above the inputs, the
    gradient left behind counted; None on the CPU), loss_dtype, loss_err and grad_err (max abs
    against ``ref``'s loss and gradient) and sm_clock_mhz (sampled mid-way through the reps)."""
    out = {}
    # 1. a first call (compilation, autotuning, lazy allocations), then correctness and memory
    #    on a fresh leaf copy of the input (some peers overwrite it)
    x = inp.detach().clone().requires_grad_(True)
    backward(loss_fn(x), x)
    x = inp.detach().clone().requires_grad_(True)

    def step():
        loss = loss_fn(x)
        return loss, backward(loss, x)

    (loss, grad), out["peak_extra_bytes"] = dev.peak_during(step)
    out["loss_dtype"] = str(loss.dtype).replace("torch.", "")
    out["loss_err"] = max_abs_diff(loss.detach(), ref[0])
    out["grad_err"] = max_abs_diff(grad, ref[1])
    del loss, grad

    # 2. warm-up, which also sizes the number of timed reps to the time budget
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(warmup):
        backward(loss_fn(x), x)
    dev.sync()
    per_rep = (time.perf_counter() - t0) / max(warmup, 1)
    reps = int(min(max_reps, max(min_reps, budget_s / max(per_rep, 1e-6))))

    # 3. timed reps: x is reused (in-place peers leave gradients in it: the time does not care)
    def clock(i, _):  # the GPU still has reps queued: its working clock
        if i == reps // 2:
            out["sm_clock_mhz"] = dev.sm_clock_mhz()

    stamps = timed_fwd_bwd(dev, lambda: loss_fn(x), lambda loss: backward(loss, x), reps,
                           dev.flush_l2, after=clock)
    out["fwd_ms"], out["bwd_ms"], out["total_ms"] = fwd_bwd_medians(dev, stamps)
    out["reps"] = reps
    return out


def measure_aligned(clock, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                    master: torch.Tensor, target: torch.Tensor, upstream: torch.Tensor, reps: int,
                    warmup: int) -> Tuple[float, float, float, Optional[torch.Tensor]]:
    """Median fwd / bwd / total ms of ``fn(x, target)`` (backward under ``upstream``) over
    ``reps`` after ``warmup``, on a copy of ``master`` restored and ``clock.align()``-ed before
    each rep (the host waits for each); and the last loss, fp32 and flat."""
    x = master.clone().requires_grad_()
    last = []

    def before():
        with torch.no_grad():
            x.copy_(master)  # peers that work in place on their input get the same logits
        clock.align()

    def forward():
        return fn(x, target)

    def backward(loss):
        return torch.autograd.grad(loss, x, upstream.to(loss.dtype).reshape(loss.shape))

    def keep(i, loss):
        last[:] = [loss.detach().float().reshape(-1)]

    timed_fwd_bwd(clock, forward, backward, warmup, before, sync_each=True, after=keep)
    stamps = timed_fwd_bwd(clock, forward, backward, reps, before, sync_each=True, after=keep)
    return (*fwd_bwd_medians(clock, stamps), last[0] if last else None)


def measure_with_grads(dev: Device, step: Callable[[], tuple], warmup_ms: float, rep_ms: float
                       ) -> Tuple[float, int, int, torch.Tensor]:
    """A step ``step() -> (loss, grads)`` measured: a first call (compilation, autotuning), the
    peak memory of a second (previous outputs freed; the gradients left behind counted), then
    ``Device.bench``. Returns ms, peak extra bytes (0 on the CPU), the gradients' bytes and the
    second call's loss (fp32)."""
    loss, grads = step()  # compile / autotune
    del grads
    dev.sync()
    dev.empty_cache()
    (loss, grads), peak = dev.peak_during(step)
    peak = peak or 0
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    loss_val = loss.detach().float().clone()
    del grads, loss
    ms = dev.bench(lambda: step(), warmup_ms, rep_ms)
    return ms, peak, grad_bytes, loss_val
