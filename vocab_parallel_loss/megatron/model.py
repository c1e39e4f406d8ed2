"""megatron-core GPTModel whose language-model loss is ``VocabParallelCrossEntropy``, or with
``fused_linear`` the fused ``linear_cross_entropy`` of the output layer's input and weight."""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Type

import torch

from . import _compat, fp32_head, losses, mtp
from .config import VocabParallelLossConfig

_compat.require_megatron()
from megatron.core.models.gpt.gpt_model import GPTModel  # noqa: E402


class VocabParallelLossMixin:
    """Overrides ``compute_language_model_loss`` of a megatron-core ``LanguageModule``, and with
    ``fused_linear`` GPTModel's ``_postprocess`` (the loss from the output layer's input and weight).

    Only the last pipeline stage builds the loss module: megatron-core calls
    ``compute_language_model_loss`` there only (``post_process``, or an MTP stage).
    """

    vocab_parallel_loss: Optional[torch.nn.Module]

    def _setup_vocab_parallel_loss(self, loss_config: Optional[VocabParallelLossConfig]) -> None:
        if loss_config is None:
            loss_config = VocabParallelLossConfig(enabled=True)
        self.loss_config = loss_config
        self._vpl_gathered_loss = None  # single-shard loss, for logits gathered over TP
        self._vpl_fused_linear = False
        needs_loss = getattr(self, "post_process", True) or getattr(self, "mtp_process", False)
        if not (loss_config.enabled and needs_loss):
            self.vocab_parallel_loss = None
            return
        if _compat.uses_fused_linear_output_layer(self.config):
            raise ValueError(
                "megatron-core's fused linear cross entropy (cross_entropy_fusion_impl='linear') "
                "computes the loss inside the output layer; disable it to use --vocab-parallel-loss"
            )
        if loss_config.fused_linear:
            self._check_fused_linear_supported()
        if loss_config.fp32_head:
            fp32_head.keep_output_layer_fp32(self)
        self.vocab_parallel_loss = losses.loss_module(_compat.tp_group_of(self), loss_config)
        self._vpl_fused_linear = bool(loss_config.fused_linear and getattr(self, "post_process", True))

    def _check_fused_linear_supported(self) -> None:
        """Fail at construction, not at the first step, where the fused linear path cannot run."""
        what = "vocab_parallel_loss --vocab-parallel-loss-fused-linear"
        if not hasattr(super(), "_postprocess"):
            raise TypeError(f"{what}: {type(self).__name__} has no GPTModel._postprocess to take over")
        if getattr(self.config, "defer_embedding_wgrad_compute", False):
            raise NotImplementedError(
                f"{what} computes the output weight's gradient itself: disable defer_embedding_wgrad_compute"
            )

    def _vpl_loss_for(self, logits: torch.Tensor) -> torch.nn.Module:
        """The loss over vocab shards, or a single-shard one for logits gathered over TP."""
        if losses.logits_are_gathered(getattr(self, "output_layer", None), logits):
            if self._vpl_gathered_loss is None:
                self._vpl_gathered_loss = losses.loss_module(None, self.loss_config)
            return self._vpl_gathered_loss
        return self.vocab_parallel_loss

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor, *args, **kwargs):
        """Per-token loss ``[b, s]`` (fp32) from ``labels [b, s]`` and ``logits [s, b, v/tp]``.

        megatron-core calls it for the main head and for every multi-token-prediction head. The
        logits are read where the output layer left them: no copy, no transpose.
        """
        if self.vocab_parallel_loss is None:
            return super().compute_language_model_loss(labels, logits, *args, **kwargs)
        return losses.logits_loss(self._vpl_loss_for(logits), labels, logits)

    def _postprocess(self, *args, **kwargs):
        """``GPTModel._postprocess``; with ``fused_linear`` and labels, every head's loss straight
        from the output layer's input and weight (``linear_cross_entropy``): no logits exist.

        Everything else (no labels, inference, an ``output_processor``) is megatron-core's own
        ``_postprocess``, so inference returns the same logits as without the fused path.
        """
        parent = super()._postprocess
        if not getattr(self, "_vpl_fused_linear", False):
            return parent(*args, **kwargs)
        call = _compat.postprocess_arguments(parent, args, kwargs)
        if _compat.postprocess_needs_logits(self, call):
            return parent(*args, **kwargs)
        hidden = call["hidden_states"]
        if getattr(self.config, "mtp_num_layers", None):
            if call.get("mtp_in_postprocess"):
                hidden = self.mtp(embedding=self.embedding, **_compat.mtp_block_arguments(self.mtp, call))
            hidden = mtp.add_mtp_losses(self, hidden, call, self._vpl_fused_linear_loss)
        return self._vpl_fused_linear_loss(hidden, call["labels"], loss_mask=call.get("loss_mask"))

    def _vpl_fused_linear_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor,
                               weight: Optional[torch.Tensor] = None,
                               loss_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Per-token loss ``[b, s]`` (fp32) of ``output_layer(hidden_states)`` against ``labels [b, s]``;
        the weight is the output layer's, or the embedding's when they are tied. ``loss_mask [b, s]``:
        what the caller multiplies the losses by (``losses.fused_linear_loss``)."""
        if weight is None:
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
                else self.output_layer.weight
        return losses.fused_linear_loss(
            hidden_states, weight, labels, output_layer=self.output_layer, config=self.config,
            loss_config=self.loss_config, tp_group=self.vocab_parallel_loss.tp_group, loss_mask=loss_mask)


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


def resolve_loss_config(loss_config: Optional[VocabParallelLossConfig]) -> VocabParallelLossConfig:
    """``loss_config``, or when None: the ``--vocab-parallel-loss*`` flags if Megatron-LM parsed
    them in this process, else the loss enabled with default settings."""
    if loss_config is not None:
        return loss_config
    args = _compat.megatron_lm_args()
    if args is not None and hasattr(args, "vocab_parallel_loss"):
        return VocabParallelLossConfig.from_args(args)
    return VocabParallelLossConfig(enabled=True)


def _language_model(module: torch.nn.Module) -> torch.nn.Module:
    """The megatron-core language model inside Megatron's wrappers (DDP, Float16Module, ...)."""
    inner = module
    while not hasattr(inner, "compute_language_model_loss") and isinstance(getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    if not hasattr(inner, "compute_language_model_loss"):
        raise TypeError(f"{type(module).__name__} is not (and does not wrap) a megatron-core language model")
    return inner


def attach_vocab_parallel_loss(model, loss_config: Optional[VocabParallelLossConfig] = None):
    """Give built megatron-core language models (``GPTModel`` or a subclass) this package's loss.

    ``model`` is one model or a list of model chunks (a Megatron-LM ``pre_wrap_hooks`` /
    ``post_wrap_hooks`` entry: ``model_cfg.pre_wrap_hooks.append(attach_vocab_parallel_loss)``);
    it is returned. Wrapped chunks (DDP, Float16Module) are unwrapped to the model. Each model's
    class becomes a subclass of its class that only overrides ``compute_language_model_loss``
    (and ``_postprocess``, which defers to megatron-core's unless ``fused_linear``); nothing in
    megatron-core is patched. ``loss_config=None``: see :func:`resolve_loss_config`.
    """
    if isinstance(model, (list, tuple)):
        for chunk in model:
            attach_vocab_parallel_loss(chunk, loss_config)
        return model
    config = resolve_loss_config(loss_config)
    inner = _language_model(model)
    if not isinstance(inner, VocabParallelLossMixin):
        cls = type(inner)
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            sub = type(f"VocabParallelLoss{cls.__name__}", (VocabParallelLossMixin, cls), {})
            _SUBCLASSES[cls] = sub
        inner.__class__ = sub
    inner._setup_vocab_parallel_loss(config)
    return model


def wrap_model_provider(
    model_provider: Callable[..., torch.nn.Module], loss_config: Optional[VocabParallelLossConfig] = None
) -> Callable[..., torch.nn.Module]:
    """Wrap a Megatron-LM model provider so that the models it builds use this package's loss:
    ``wrap_model_provider(partial(model_provider, gpt_builder))`` in ``pretrain_gpt.py``.

    ``loss_config=None``: the ``--vocab-parallel-loss*`` flags (:func:`resolve_loss_config`);
    without ``--vocab-parallel-loss`` the model keeps megatron-core's loss. The wrapper has the
    provider's signature (``functools.wraps``). Megatron-LM 0.19 and later build the model from a
    ``GPTModelConfig`` and do not call a model provider: use :func:`attach_vocab_parallel_loss`
    as a ``pre_wrap_hooks`` entry there.
    """

    @functools.wraps(model_provider)
    def provider(*args: Any, **kwargs: Any) -> torch.nn.Module:
        return attach_vocab_parallel_loss(model_provider(*args, **kwargs), loss_config)

    return provider
