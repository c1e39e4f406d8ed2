"""Drop-ins with the signatures of TransformerEngine's ``parallel_cross_entropy`` and
megatron-core's ``vocab_parallel_cross_entropy``, computed by ``functional.cross_entropy``."""

from __future__ import annotations

import warnings
from typing import Optional

import torch

from .functional import cross_entropy
from .ops.cross_entropy import contract


def parallel_cross_entropy(
    inp: Optional[torch.Tensor] = None,
    target: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
    reduce_loss: bool = False,
    dist_process_group=None,
    ignore_idx: int = -100,
    is_cg_capturable: bool = False,
    z_loss_weight: float = 0.0,
    *,
    overwrite_input: bool = False,
    return_log_sum_exp: bool = False,
    _input: Optional[torch.Tensor] = None,
):
    """Drop-in for TransformerEngine's ``parallel_cross_entropy``.

    ``inp`` is ``(B, SQ, V_local)`` or ``(SQ, B, V_local)`` (any strides), ``target`` has the same
    two leading dims. Returns the fp32 per-token loss shaped like ``target``, or with
    ``reduce_loss=True`` its mean over non-ignored tokens. ``is_cg_capturable`` is accepted for
    compatibility: this implementation never synchronises with the host, so it is always
    capturable. ``z_loss_weight`` adds ``z_loss_weight * lse**2`` per token.
    ``overwrite_input=True`` writes the gradient over ``inp`` during backward (no gradient
    buffer); ``inp`` keeps its values until then. ``return_log_sum_exp=True`` returns
    ``(loss, lse)``: the fp32 full-vocabulary log-sum-exp per token, shaped like ``target``, 0 for
    ignored tokens and not differentiable; it costs one more read of ``inp``. ``_input`` is the
    deprecated name of ``inp``.
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
    try:
        contract.check_options(label_smoothing, ignore_idx, "none", z_loss_weight,
                               dist_process_group)
    except (TypeError, ValueError) as err:  # the arguments named as TransformerEngine names them
        raise type(err)(str(err).replace("z_loss", "z_loss_weight")
                        .replace("ignore_index", "ignore_idx")
                        .replace("tp_group", "dist_process_group")) from None
    options = dict(tp_group=dist_process_group, label_smoothing=label_smoothing,
                   ignore_index=ignore_idx, z_loss=z_loss_weight)
    if overwrite_input:
        # per token, then reduced here: the gradient reaches inp only in backward (a reduced loss
        # on one shard would otherwise form it in the forward kernel, over inp's values)
        loss = cross_entropy(inp, target, reduction="none", inplace_backward=True,
                             return_lse=return_log_sum_exp, **options)
        lse = None
        if return_log_sum_exp:
            loss, lse = loss
        if reduce_loss:
            loss = loss.sum() / (target.long() != ignore_idx).sum().clamp(min=1)
        return (loss, lse) if return_log_sum_exp else loss
    return cross_entropy(inp, target, reduction="mean" if reduce_loss else "none",
                         return_lse=return_log_sum_exp, **options)


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
                                 label_smoothing: float = 0.0, tp_group=None) -> torch.Tensor:
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
