"""The losses are differentiable once: their backward runs kernels (or PyTorch code on saved,
detached statistics) that autograd does not differentiate again."""

from __future__ import annotations


def refuse_double_backward(name: str) -> None:
    """Raise for a backward that records a graph (``create_graph=True``): a second derivative
    through the loss would otherwise come out missing (zero) or wrong, without an error."""
    raise RuntimeError(
        f"{name} has no second derivative: differentiating its gradient again "
        "(create_graph=True, as for Hessian-vector products or gradient penalties) "
        "is not supported")


def consume(ctx, what: str) -> None:
    """Note that this backward turns ``what`` into gradients in place (saved tiles become dz,
    fp32 accumulators are scaled): ``refuse_if_consumed`` then refuses a second backward."""
    ctx.consumed = what


def refuse_if_consumed(ctx, name: str) -> None:
    """Raise, naming the way out, for a second backward through a graph whose first one used
    its saved state up. Call before unpacking ``saved_tensors`` (autograd would otherwise name a
    tensor version instead)."""
    what = getattr(ctx, "consumed", None)
    if what:
        raise RuntimeError(
            f"{name}: a second backward through the same outputs; the first turned {what} "
            f"into gradients (memory_budget allowed a strategy that works in place). Pass "
            f"memory_budget=0 to backward twice.")
