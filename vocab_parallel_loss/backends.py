"""Which implementation runs a call: the Triton kernels or the pure-PyTorch reference.

Triton runs CUDA tensors, and CPU tensors when ``TRITON_INTERPRET`` is on (Triton's interpreter);
everything else runs PyTorch. Both have the same semantics (the test suite compares them).
"""

from __future__ import annotations

import torch

from . import settings
from .reference import linear as torch_linear
from .reference import logits as torch_logits

try:  # Triton is optional at import time: the PyTorch backends cover its absence
    from .kernels import linear as triton_linear
    from .kernels import logits as triton_logits
    from .kernels import logprobs as triton_logprobs
except Exception:  # pragma: no cover - depends on the platform
    triton_linear = triton_logits = triton_logprobs = None

#: ``impl`` values of the fused linear loss
IMPLS = ("auto", "triton", "torch")


def triton_runs(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``'s device here."""
    if triton_logits is None:
        return False
    return t.is_cuda or (t.device.type == "cpu" and settings.interpreting())


def logits_backend(t: torch.Tensor):
    """The backend module of the loss over logits for logits ``t``: float64 logits always run
    PyTorch, in float64 (the kernels accumulate in fp32)."""
    if t.dtype is torch.float64:
        return torch_logits
    return triton_logits if triton_runs(t) else torch_logits


def linear_backend(impl: str, t: torch.Tensor):
    """The backend of the fused linear loss for ``impl`` and hidden states ``t``."""
    if impl == "torch":
        return torch_linear.TorchBackend
    if t.dtype == torch.float64:  # the kernels accumulate in fp32: fp64 inputs use PyTorch
        if impl == "triton":
            raise ValueError("impl='triton' supports fp32, bf16 and fp16 inputs; "
                             "use impl='torch' for float64")
        return torch_linear.TorchBackend
    if impl == "triton":
        if triton_linear is None:
            raise ValueError("impl='triton' but Triton could not be imported; use impl='torch'")
        if not triton_runs(t):
            raise ValueError(f"impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU), "
                             f"got a tensor on {t.device}; use impl='torch' or 'auto'")
        return triton_linear
    return triton_linear if triton_runs(t) else torch_linear.TorchBackend
