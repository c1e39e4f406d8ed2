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
