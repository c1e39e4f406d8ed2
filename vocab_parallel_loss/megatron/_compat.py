"""Every difference between megatron-core versions (0.14 - 0.20) is handled here, and only here.

* The model's tensor-parallel group: ``model.pg_collection.tp`` (0.14+), ``model.model_comm_pgs.tp``
  (the name some releases used), ``model.tp_group``, else ``parallel_state``'s global group.
* megatron-core's own losses, for comparisons: ``fused_vocab_parallel_cross_entropy`` takes the TP
  group as a third argument on newer releases only.
* Whether a model routes its loss around ``compute_language_model_loss`` (the fused linear
  cross-entropy output layer of newer releases, ``cross_entropy_fusion_impl == "linear"``).
* ``TransformerConfig`` keyword arguments that a release does not know are dropped.
* ``GPTModel._postprocess`` (0.14+) gains keyword arguments from release to release (``padding_mask``,
  ``output_processor``, ...); :func:`postprocess_arguments` reads its call by name. Whether it is in
  inference mode: ``inference_context`` given while not training (0.14 - 0.18), megatron-core's
  ``InferenceMode`` (0.19).
* MuP's output multiplier on the logits (``config.use_mup``, 0.19+).
* Multi-token prediction: the MTP block's forward arguments (read from the ``_postprocess`` call),
  the context-parallel group, how a head's loss is logged (loss only up to 0.19; loss and
  acceptance counts on 0.20) and scaled under ``calculate_per_token_loss`` (rescaled by the
  tokens lost to rolling from 0.17, when ``process_mtp_loss`` appeared).
* Megatron-LM (not megatron-core): its parsed arguments, read without importing it.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
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


def postprocess_arguments(method: Any, args: tuple, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The arguments of a call of a (bound) ``GPTModel._postprocess`` by name, defaults filled in.

    Its parameters differ across releases; ``forward`` passes them by keyword, but a positional
    call binds the same way.
    """
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _inference_mode_active() -> bool:
    try:  # 0.19+: a global switch replaces "an inference context while not training"
        from megatron.core.inference.utils import InferenceMode
    except ImportError:
        return False
    is_active = getattr(InferenceMode, "is_active", None)
    return bool(is_active()) if callable(is_active) else False


def postprocess_needs_logits(model: Any, call: Dict[str, Any]) -> bool:
    """True when ``GPTModel._postprocess`` must run as megatron-core wrote it (materialized logits).

    That is: no labels (logits are the output), no post-process stage, inference (megatron-core
    may keep only the last token's logits there), or an ``output_processor`` that takes the
    output layer itself.
    """
    if call.get("labels") is None or not getattr(model, "post_process", True):
        return True
    if call.get("output_processor") is not None:
        return True
    if call.get("inference_context") is not None and not model.training:
        return True
    return _inference_mode_active()


def output_logit_scale(config: Any) -> float:
    """The factor megatron-core multiplies the output layer's logits by: MuP's ``mup_output_mult``
    when ``use_mup`` (0.19+), else 1."""
    if not getattr(config, "use_mup", False):
        return 1.0
    mult = getattr(config, "mup_output_mult", 1.0)
    return 1.0 if mult is None else float(mult)


def megatron_lm_args() -> Optional[Any]:
    """Megatron-LM's parsed arguments (``megatron.training.get_args()``) in this process, else None.

    Read from the module, never imported: megatron-core alone has no ``megatron.training``, and a
    process that never imported it has no Megatron-LM arguments.
    """
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def cp_group_of(model: Any) -> Optional["torch.distributed.ProcessGroup"]:
    """The context-parallel group of a megatron-core model (None: no context parallelism)."""
    pgs = getattr(model, "pg_collection", None)
    group = getattr(pgs, "cp", None) if pgs is not None else None
    return group if group is not None else getattr(model, "cp_group", None)


def mtp_block_arguments(block: Any, call: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments ``GPTModel._postprocess`` gives its MTP block, from its own call.

    Every release passes the block the ``_postprocess`` arguments of the same name, the embedding
    and ``extra_block_kwargs`` spread out; the names the block takes differ (``padding_mask``, 0.20).
    """
    params = inspect.signature(block.forward).parameters
    kwargs = {name: call[name] for name in params if name in call and name != "extra_block_kwargs"}
    kwargs.update(call.get("extra_block_kwargs") or {})
    return kwargs


def roll_labels(tensor: torch.Tensor, call: Dict[str, Any], cp_group) -> tuple:
    """megatron-core's ``roll_tensor`` one position left: ``(rolled, rolled.sum())``."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    kwargs = filter_kwargs(roll_tensor, dict(cp_group=cp_group, packed_seq_params=call.get("packed_seq_params")))
    return roll_tensor(tensor, shifts=-1, dims=-1, **kwargs)


def mtp_rescales_per_token_loss() -> bool:
    """Whether a head's loss is multiplied by (tokens before rolling) / (tokens after rolling) under
    ``calculate_per_token_loss`` (0.17+, the releases with ``process_mtp_loss``)."""
    from megatron.core.transformer import multi_token_prediction

    return hasattr(multi_token_prediction, "process_mtp_loss")


def log_mtp_head(loss: torch.Tensor, layer: int, num_layers: int, acceptance) -> None:
    """Record a head's mean loss where megatron-core's training loop reports it; on releases that
    also report the acceptance rate, ``acceptance()`` gives its ``(correct, total)`` counts."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    avg_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    save_metrics = getattr(MTPLossLoggingHelper, "save_metrics_to_tracker", None)
    if save_metrics is not None:
        correct, total = acceptance()
        save_metrics(loss, correct, total, layer, num_layers, avg_group=avg_group)
    else:
        MTPLossLoggingHelper.save_loss_to_tracker(loss, layer, num_layers, avg_group=avg_group)
