"""megatron-core GPTModel whose language-model loss is ``VocabParallelCrossEntropy``, or with
``fused_linear`` the fused ``linear_cross_entropy`` of the output layer's input and weight."""

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
        self.vocab_parallel_loss = _loss_module(_compat.tp_group_of(self), loss_config)
        self._vpl_fused_linear = bool(loss_config.fused_linear and getattr(self, "post_process", True))

    def _check_fused_linear_supported(self) -> None:
        """Fail at construction, not at the first step, where the fused linear path cannot run."""
        what = "vocab_parallel_loss --vocab-parallel-loss-fused-linear"
        if not hasattr(super(), "_postprocess"):
            raise TypeError(f"{what}: {type(self).__name__} has no GPTModel._postprocess to take over")
        if getattr(self.config, "mtp_num_layers", None):
            raise NotImplementedError(f"{what} does not support multi-token prediction (mtp_num_layers)")
        if getattr(self.config, "defer_embedding_wgrad_compute", False):
            raise NotImplementedError(
                f"{what} computes the output weight's gradient itself: disable defer_embedding_wgrad_compute"
            )

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

    def _postprocess(self, *args, **kwargs):
        """``GPTModel._postprocess``; with ``fused_linear`` and labels, the loss straight from the
        output layer's input and weight (``linear_cross_entropy``): the logits never exist.

        Everything else (no labels, inference, multi-token prediction) is megatron-core's own
        ``_postprocess``, so inference returns the same logits as without the fused path.
        """
        parent = super()._postprocess
        if not getattr(self, "_vpl_fused_linear", False):
            return parent(*args, **kwargs)
        call = _compat.postprocess_arguments(parent, args, kwargs)
        if _compat.postprocess_needs_logits(self, call):
            return parent(*args, **kwargs)
        return self._vpl_fused_linear_loss(call["hidden_states"], call["labels"])

    def _vpl_fused_linear_loss(self, hidden_states: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss ``[b, s]`` (fp32) of ``output_layer(hidden_states)`` against ``labels [b, s]``.

        ``hidden_states`` is ``[s, b, h]``, or this rank's ``[s/tp, b, h]`` under sequence
        parallelism (gathered inside the loss, its gradient reduce-scattered, as the output layer
        does). The weight is the output layer's, or the embedding's when they are tied.
        """
        from ..functional import linear_cross_entropy

        out = self.output_layer
        if self.share_embeddings_and_output_weights:
            weight = self.shared_embedding_or_output_weight()
        else:
            weight = out.weight
        bias = getattr(out, "bias", None)  # GPTModel's output layer has none
        if bias is not None and getattr(out, "skip_bias_add", False):
            bias = None  # megatron-core returns it apart and leaves it out of the logits
        if hidden_states.dtype != weight.dtype:
            hidden_states = hidden_states.to(weight.dtype)
        scale = _compat.output_logit_scale(self.config)
        if scale != 1.0:  # s * (e @ c.T + b) == (s * e) @ c.T + s * b
            hidden_states = hidden_states * scale
            bias = None if bias is None else bias * scale
        cfg = self.loss_config
        target = labels.transpose(0, 1).contiguous()  # [s, b], like the hidden states
        loss = linear_cross_entropy(
            hidden_states, weight, target, bias,
            ignore_index=cfg.ignore_index, reduction="none",
            tp_group=self.vocab_parallel_loss.tp_group,
            sequence_parallel=bool(getattr(out, "sequence_parallel", False)),
            label_smoothing=cfg.label_smoothing, z_loss=cfg.z_loss, impl="auto",
        )  # [s, b], fp32
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
    ``compute_language_model_loss`` (and ``_postprocess``, which defers to megatron-core's unless
    ``fused_linear``); nothing in megatron-core is patched.
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
