"""The backends: the interface each op's backends implement, and which one runs a call.

Every op has a Triton backend (``kernels/``: CUDA tensors, and CPU tensors when
``TRITON_INTERPRET`` is on) and a pure-PyTorch one (``reference/``: everything else, and float64
inputs). Both have the same semantics (the test suite compares them). What a backend can do
beyond the common interface is a declared capability, read by the ops: never its identity.
"""

from __future__ import annotations

from typing import Protocol, Tuple, runtime_checkable

import torch

from . import settings
from .checks import IMPLS  # noqa: F401  (the ``impl`` values ``linear_backend`` chooses between)
from .reference import linear as torch_linear_module
from .reference import logits as torch_logits
from .reference import logprobs as torch_logprobs

try:  # Triton is optional at import time: the PyTorch backends cover its absence
    from .kernels import linear as triton_linear
    from .kernels import logits as triton_logits
    from .kernels import logprobs as triton_logprobs
except Exception:  # pragma: no cover - depends on the platform
    triton_linear = triton_logits = triton_logprobs = None

torch_linear = torch_linear_module.TorchBackend


@runtime_checkable
class LogitsBackend(Protocol):
    """The loss over logits, one shard's rows (``ops/cross_entropy``). ``lse`` is ``(2, N)``:
    the lse and its low part (``formulas.lse_low``), written by ``forward``/``merge`` and read
    by ``backward``."""

    NAME: str
    #: a reduced loss on one shard can form its gradient in the forward pass (``forward_grad``,
    #: ``count``, and ``backward(..., unless_unit=True)``)
    FORMS_REDUCED_GRADIENT: bool

    def forward(self, view, target, opts, stats=None, loss=None, lse=None, memo=None): ...
    def merge(self, gathered, target, loss, lse, opts): ...
    def reduce(self, loss, target, ignore_index, mean, memo=None): ...
    def backward(self, view, dview, target, lse, dloss, count, opts, memo=None): ...


@runtime_checkable
class RowsBackend(Protocol):
    """Log-prob statistics and their gradient over rows of logits (``ops/token_logprobs``);
    ``backward``'s ``lse`` is ``(2, N)``: the lse and its low part (``formulas.lse_low``)."""

    NAME: str
    TRACEABLE: bool  #: torch.compile traces it (else it runs as a graph break)

    def stats(self, view, target, inv_t, col_start, valid, scale, softcap, out): ...
    def backward(self, view, dview, target, inv_t, lse, ent, g_lp, g_ent, col_start, valid,
                 scale, softcap): ...


@runtime_checkable
class LinearBackend(Protocol):
    """The fused linear engine: logits statistics and gradients from hidden states and classifier
    rows without the logits (``ops/linear_cross_entropy``, ``ops/linear_token_logprobs``)."""

    NAME: str
    TRACEABLE: bool  #: torch.compile traces it (else it runs as a graph break)
    #: the ways to form the gradients it runs (``ops.fused_linear.strategy``); with "saved" it
    #: also has ``default_config``, ``saved_tiles``, ``SavedTiles``, ``backward_saved`` and
    #: ``parts_bytes``, and its ``forward_stats`` takes the strategy's ``room``
    STRATEGIES: Tuple[str, ...]

    #: ``logprob`` (``formulas.LogprobArgs``): the log-prob mode, ``(5, N)`` statistics and
    #: ``(6, N)`` coefficients (``ops/linear_token_logprobs``)
    def forward_stats(self, e, c, bias, targets, v_offset, softcap, need_sumx, logprob=None,
                      **kw): ...
    def backward(self, e, c, bias, targets, v_offset, coef, softcap, need_de, need_dc,
                 need_db, de_acc=None, dc_out=None, dc_acc=None, logprob=None, **kw): ...


def triton_runs(t: torch.Tensor) -> bool:
    """Whether the Triton kernels can run on ``t``'s device here."""
    if triton_logits is None:
        return False
    return t.is_cuda or (t.device.type == "cpu" and settings.interpreting())


def logits_backend(t: torch.Tensor) -> LogitsBackend:
    """The backend of the loss over logits for logits ``t``: float64 logits always run
    PyTorch, in float64 (the kernels accumulate in fp32)."""
    if t.dtype is torch.float64:
        return torch_logits
    return triton_logits if triton_runs(t) else torch_logits


def linear_backend(impl: str, t: torch.Tensor) -> LinearBackend:
    """The backend of the fused linear ops for ``impl`` and hidden states ``t``."""
    if impl == "torch":
        return torch_linear
    if t.dtype == torch.float64:  # the kernels accumulate in fp32: fp64 inputs use PyTorch
        if impl == "triton":
            raise ValueError("impl='triton' supports fp32, bf16 and fp16 inputs; "
                             "use impl='torch' for float64")
        return torch_linear
    if impl == "triton":
        if triton_linear is None:
            raise ValueError("impl='triton' but Triton could not be imported; use impl='torch'")
        if not triton_runs(t):
            raise ValueError(f"impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU), "
                             f"got a tensor on {t.device}; use impl='torch' or 'auto'")
        return triton_linear
    return triton_linear if triton_runs(t) else torch_linear
