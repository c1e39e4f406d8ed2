"""megatron-core GPTModel whose language-model loss is ``VocabParallelCrossEntropy``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Type

import torch

from . import _compat
from .config import VocabParallelLossConfig

_compat.require_megatron()
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402


def _loss_module(tp_group, loss_config: VocabParallelLossConfig) -> torch.nn.Module:
    from vocab_parallel_loss import VocabParallelCrossEntropy

    return VocabParallelCrossEntropy(tp_group, **loss_config.loss_kwargs())


class VocabParallelLossMixin:
    """Overrides ``compute_language_model_loss`` of a megatron-core ``LanguageModule``.

    Only the last pipeline stage builds the loss module: megatron-core calls
    ``compute_language_model_loss`` there only (``post_process``, or an MTP stage).
    """

    vocab_parallel_loss: Optional[torch.nn.Module]

    def _setup_vocab_parallel_loss(self, loss_config: Optional[VocabParallelLossConfig]) -> None:
        if loss_config is None:
            loss_config = VocabParallelLossConfig(enabled=True)
        self.loss_config = loss_config
        self._vpl_gathered_loss = None  # single-shard loss, for logits gathered over TP
        needs_loss = getattr(self, "post_process", True) or getattr(self, "mtp_process", False)
        if not (loss_config.enabled and needs_loss):
            self.vocab_parallel_loss = None
            return
        if loss_config.fused_linear:
            raise NotImplementedError(
                "vocab_parallel_loss: the fused linear path (--vocab-parallel-loss-fused-linear) "
                "is not wired into the Megatron model yet"
            )
        if _compat.uses_fused_linear_output_layer(self.config):
            raise ValueError(
                "megatron-core's fused linear cross entropy (cross_entropy_fusion_impl='linear') "
                "computes the loss inside the output layer; disable it to use --vocab-parallel-loss"
            )
        self.vocab_parallel_loss = _loss_module(_compat.tp_group_of(self), loss_config)

    def _vpl_loss_for(self, logits: torch.Tensor) -> torch.nn.Module:
        """The loss over vocab shards, or a single-shard one for logits gathered over TP."""
        out = getattr(self, "output_layer", None)
        full = getattr(out, "output_size", None)
        local = getattr(out, "output_size_per_partition", full)
        if full is not None and full != local and logits.size(-1) == full:
            if self._vpl_gathered_loss is None:
                self._vpl_gathered_loss = _loss_module(None, self.loss_config)
            return self._vpl_gathered_loss
        return self.vocab_parallel_loss

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor, *args, **kwargs):
        """Per-token loss ``[b, s]`` (fp32) from ``labels [b, s]`` and ``logits [s, b, v/tp]``.

        The logits are read where the output layer left them: no copy, no transpose.
        """
        if self.vocab_parallel_loss is None:
            return super().compute_language_model_loss(labels, logits, *args, **kwargs)
        target = labels.transpose(0, 1)  # [s, b]; a copy of N integers at most
        if not target.is_contiguous():
            target = target.contiguous()
        loss = self._vpl_loss_for(logits)(logits, target)  # [s, b], fp32
        return loss.transpose(0, 1).contiguous()


class VocabParallelLossGPTModel(VocabParallelLossMixin, GPTModel):
    """megatron-core ``GPTModel`` with the exact vocab-parallel loss.

    Takes ``GPTModel``'s arguments (whatever the installed megatron-core release accepts) plus
    ``loss_config``: a :class:`VocabParallelLossConfig`; ``None`` enables the loss with defaults,
    ``enabled=False`` keeps megatron-core's own loss (``--cross-entropy-loss-fusion`` included).
    The loss module runs on the model's tensor-parallel group.
    """

    def __init__(self, *args: Any, loss_config: Optional[VocabParallelLossConfig] = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._setup_vocab_parallel_loss(loss_config)


_SUBCLASSES: Dict[type, Type] = {GPTModel: VocabParallelLossGPTModel}


def attach_vocab_parallel_loss(model: torch.nn.Module, loss_config: Optional[VocabParallelLossConfig] = None):
    """Give an already built megatron-core language model (``GPTModel`` or a subclass) our loss.

    The instance's class becomes a subclass of its class that only overrides
    ``compute_language_model_loss``; nothing in megatron-core is patched.
    """
    if isinstance(model, VocabParallelLossMixin):
        model._setup_vocab_parallel_loss(loss_config)
        return model
    cls = type(model)
    if not hasattr(cls, "compute_language_model_loss"):
        raise TypeError(f"{cls.__name__} is not a megatron-core language model")
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"VocabParallelLoss{cls.__name__}", (VocabParallelLossMixin, cls), {})
        _SUBCLASSES[cls] = sub
    model.__class__ = sub
    model._setup_vocab_parallel_loss(loss_config)
    return model


def wrap_model_provider(
    model_provider: Callable[..., torch.nn.Module], loss_config: Optional[VocabParallelLossConfig] = None
) -> Callable[..., torch.nn.Module]:
    """Wrap a Megatron-LM model provider so that the models it builds use our loss.

    ``loss_config=None`` reads the ``--vocab-parallel-loss*`` flags from Megatron-LM's global args
    (``megatron.training.get_args()``). Without ``--vocab-parallel-loss`` the model keeps
    megatron-core's loss. The wrapper has the provider's signature (``functools.wraps``).
    """

    @functools.wraps(model_provider)
    def provider(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = model_provider(*args, **kwargs)
        config = loss_config
        if config is None:
            from megatron.training import get_args

            config = VocabParallelLossConfig.from_args(get_args())
        return attach_vocab_parallel_loss(model, config)

    return provider
