"""Drop-ins with the signatures of TransformerEngine's ``parallel_cross_entropy`` and
megatron-core's ``vocab_parallel_cross_entropy``, computed by ``functional.cross_entropy``."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .functional import cross_entropy


def parallel_cross_entropy(
    inp: Optional[torch.Tensor] = None,
    target: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group=None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    *,
    _input: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for TransformerEngine's ``parallel_cross_entropy``.

    ``inp`` is ``(B, SQ, V_local)`` or ``(SQ, B, V_local)`` (any strides), ``target`` has the same
    two leading dims. Returns the fp32 per-token loss shaped like ``target``, or with
    ``reduce_loss=True`` its mean over non-ignored tokens. ``is_cg_capturable`` is accepted for
    compatibility: this implementation never synchronises with the host, so it is always
    capturable. ``_input`` is the deprecated name of ``inp``.
    """
    del is_cg_capturable  # always capturable
    if _input is not None:
        warnings.warn("`_input` is deprecated; pass the logits as `inp`", FutureWarning,
                      stacklevel=2)
        if inp is not None:
            raise ValueError("pass the logits as `inp` or as the deprecated `_input`, not both")
        inp = _input
    if inp is None or target is None:
        raise ValueError("parallel_cross_entropy needs `inp` and `target`")
    return cross_entropy(inp, target, tp_group=dist_process_group,
                         label_smoothing=label_smoothing, ignore_index=ignore_idx,
                         reduction="mean" if reduce_loss else "none")


def _megatron_tp_group():
    """Megatron's tensor-parallel group when megatron-core is initialised, else None."""
    try:
        from megatron.core import parallel_state
    except Exception:
        return None
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0, *, tp_group=None) -> torch.Tensor:
    """Drop-in for ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``.

    Per-token fp32 loss with the target's shape. ``tp_group=None`` uses megatron-core's tensor
    model parallel group when it is initialised (as Megatron does), else no parallelism.
    Differences from megatron-core: label smoothing is exact (PyTorch's convention over the
    global vocabulary; Megatron uses the local vocabulary size), targets equal to -100 are
    ignored (loss 0), and the caller's logits are never modified.
    """
    group = tp_group if tp_group is not None else _megatron_tp_group()
    return cross_entropy(vocab_parallel_logits, target, tp_group=group,
                         label_smoothing=label_smoothing)
