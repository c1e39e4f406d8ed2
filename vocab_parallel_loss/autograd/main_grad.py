"""megatron-core's gradient-accumulation fusion, as the fused losses take part in it: the
weight's gradient is added into ``weight.main_grad`` in backward, and autograd receives a dummy.
"""

from __future__ import annotations

from typing import Optional

import torch


def requested(config, weight: torch.Tensor) -> bool:
    """Whether the fused losses add this weight's gradient into its ``main_grad``, as
    megatron-core's output layer would: the model config's ``gradient_accumulation_fusion`` and
    a ``main_grad`` that DDP gave the weight. Not under Megatron-FSDP (``__fsdp_param__``),
    whose ``main_grad`` is fetched anew in backward (``get_main_grad``) and may be stale before:
    there the gradient is returned, and its hook accumulates it."""
    if getattr(weight, "__fsdp_param__", False):
        return False
    return bool(getattr(config, "gradient_accumulation_fusion", False)) and isinstance(
        getattr(weight, "main_grad", None), torch.Tensor)


def home(c: torch.Tensor, enabled: bool, needed: bool) -> Optional[torch.Tensor]:
    """``c.main_grad`` when the call adds the gradient of ``c`` there, else None."""
    return c.main_grad if enabled and needed else None


def dummy(c: torch.Tensor) -> Optional[torch.Tensor]:
    """What autograd receives for ``c`` once its gradient is in ``c.main_grad``: megatron-core's
    protocol (``ColumnParallelLinear``). Zeros, flagged by ``grad_added_to_main_grad`` so that
    DDP's hook does not add them again (a tied embedding's own gradient then still arrives,
    summed with zeros); None where ``c`` has no such flag. Zeros rather than megatron-core's
    uninitialized buffer: nothing reads garbage if no hook runs. One element expanded: autograd
    makes it dense only after the node's saved tensors are freed."""
    if not hasattr(c, "grad_added_to_main_grad"):
        return None
    c.grad_added_to_main_grad = True
    return torch.zeros((), dtype=c.dtype, device=c.device).expand(c.shape)
