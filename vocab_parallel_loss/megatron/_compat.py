"""Every difference between megatron-core versions (0.14 - 0.19) is handled here, and only here.

* The model's tensor-parallel group: ``model.pg_collection.tp`` (0.14+), ``model.model_comm_pgs.tp``
  (the name some releases used), ``model.tp_group``, else ``parallel_state``'s global group.
* megatron-core's own losses, for comparisons: ``fused_vocab_parallel_cross_entropy`` takes the TP
  group as a third argument on newer releases only.
* Whether a model routes its loss around ``compute_language_model_loss`` (the fused linear
  cross-entropy output layer of newer releases, ``cross_entropy_fusion_impl == "linear"``).
* ``TransformerConfig`` keyword arguments that a release does not know are dropped.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, Optional

import torch

try:  # megatron-core is an optional dependency of the package
    import megatron.core as _mcore
    from megatron.core import parallel_state, tensor_parallel

    HAVE_MEGATRON = True
except ImportError:  # pragma: no cover - exercised only without megatron-core
    _mcore = None
    parallel_state = None
    tensor_parallel = None
    HAVE_MEGATRON = False


def require_megatron() -> None:
    if not HAVE_MEGATRON:
        raise ImportError(
            "vocab_parallel_loss.megatron needs megatron-core (pip install 'vocab_parallel_loss[megatron]')"
        )


def megatron_version() -> str:
    require_megatron()
    return getattr(_mcore, "__version__", "unknown")


def tp_group_of(model: Any) -> Optional["torch.distributed.ProcessGroup"]:
    """The tensor-parallel process group a megatron-core model was built on.

    ``None`` when torch.distributed is not initialized (a single shard, no communication).
    """
    for attr in ("pg_collection", "model_comm_pgs"):
        pgs = getattr(model, attr, None)
        group = getattr(pgs, "tp", None) if pgs is not None else None
        if group is not None:
            return group
    group = getattr(model, "tp_group", None)
    if group is not None:
        return group
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    require_megatron()
    try:
        return parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    except TypeError:  # releases without the keyword
        return parallel_state.get_tensor_model_parallel_group()


def uses_fused_linear_output_layer(config: Any) -> bool:
    """True when megatron-core itself fuses the output layer with the loss (newer releases).

    That path computes the loss inside the output layer and never calls
    ``compute_language_model_loss``, so our loss could not take over.
    """
    return bool(getattr(config, "cross_entropy_loss_fusion", False)) and (
        getattr(config, "cross_entropy_fusion_impl", None) == "linear"
    )


def native_vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp_group=None, *, fused: bool = False
) -> torch.Tensor:
    """megatron-core's own loss on ``logits [s, b, v/tp]``, ``target [s, b]``; returns ``[s, b]``.

    The unfused one works in place on fp32 logits (a megatron-core quirk): pass a clone if the
    logits are used afterwards.
    """
    require_megatron()
    if not fused:
        return tensor_parallel.vocab_parallel_cross_entropy(logits, target)
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    params = inspect.signature(fused_vocab_parallel_cross_entropy).parameters
    if len(params) >= 3:
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
        return fused_vocab_parallel_cross_entropy(logits, target, tp_group)
    return fused_vocab_parallel_cross_entropy(logits, target)


def transformer_config(**kwargs: Any):
    """Build a ``TransformerConfig``, dropping keywords this megatron-core release does not know."""
    require_megatron()
    from megatron.core.transformer.transformer_config import TransformerConfig

    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    return TransformerConfig(**{k: v for k, v in kwargs.items() if k in known})


def filter_kwargs(fn: Any, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Keep only the keyword arguments ``fn`` accepts (constructors differ across releases)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


def model_parallel_seed(seed: int) -> None:
    """Seed torch (and megatron-core's CUDA RNG tracker when a GPU is present)."""
    require_megatron()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
