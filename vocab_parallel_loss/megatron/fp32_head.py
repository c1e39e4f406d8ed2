"""An fp32 output layer (LM head) in a bf16 / fp16 megatron-core model (``--vocab-parallel-loss-fp32-head``).

RL stacks keep the output layer's weight in fp32 so that the trainer's log-probs match the
inference engine's (SGLang's ``enable_fp32_lm_head``, vLLM, NeMo-RL's and slime's fp32 LM head).
Megatron-LM makes a model 16-bit after building it: ``Float16Module`` calls ``module.bfloat16()``
(or ``half()``), after ``module.cuda()``; then DDP groups the parameters into grad buffers by
dtype and the (distributed) optimizer keeps fp32 parameters in its fp32 groups, updating them in
place. So one fp32 parameter only has to survive that conversion.

:func:`keep_output_layer_fp32` makes the model's output layer (megatron-core's
``ColumnParallelLinear``) an instance of a subclass of its class that

* upcasts its parameters to fp32 once (values of the model's ``params_dtype``: under ``--bf16``
  Megatron-LM initializes in bf16, so the initial weight holds bf16 values; a checkpoint's fp32
  values load in full: ``load_state_dict`` copies into the fp32 parameter), and
* keeps them fp32 through every ``Module._apply`` that would cast them to bf16 / fp16
  (``bfloat16()``, ``half()``, ``to(dtype)``), while still applying device moves (``cuda()``,
  ``to(device)``). torch's ``_apply`` recurses into every child, so this holds whichever
  ancestor is converted;
* casts 16-bit inputs to fp32 in ``forward``: where the logits are materialized (no labels,
  inference, the unfused loss, megatron-core's own MTP heads) they are fp32 logits of the
  hidden states cast to fp32. The fused losses take the 16-bit hidden states as they are (the
  fused linear ops compute as for them cast to fp32, without the copy).

Being a parameter of the model, the weight gets an fp32 ``main_grad`` from DDP and is saved and
loaded in fp32 (``state_dict`` and ``sharded_state_dict`` hold the parameter itself). It must be
kept fp32 before DDP wraps the model (a model provider or a ``pre_wrap_hooks`` entry):
afterwards its grad buffer is already laid out, and this raises. Tied embeddings share the
output weight with the input embedding, whose lookups feed the 16-bit decoder: refused.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Type

import torch

from . import _compat

_SIXTEEN_BIT = (torch.bfloat16, torch.float16)
FLAG = "--vocab-parallel-loss-fp32-head"


class Fp32OutputLayerMixin:
    """The behaviour :func:`keep_output_layer_fp32` gives an output layer (module docstring)."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any, **kwargs: Any):
        return super()._apply(_keeping_fp32(fn), *args, **kwargs)

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any):
        if input_.dtype in _SIXTEEN_BIT and self.weight is not None and self.weight.dtype == torch.float32:
            input_ = input_.float()
        return super().forward(input_, *args, **kwargs)


def _keeping_fp32(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn``, except that an fp32 tensor it would make 16-bit only takes its device."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        if t.dtype == torch.float32 and out.dtype in _SIXTEEN_BIT:
            return t.detach().to(device=out.device)  # t's storage itself on the same device
        return out

    return apply


_SUBCLASSES: Dict[type, Type] = {}


def keep_output_layer_fp32(model):
    """Keep the output layer's parameters of megatron-core language model(s) fp32 (module docstring).

    ``model``: one model or a list of model chunks, wrapped (Float16Module) or not; returned, so
    that it serves as a Megatron-LM ``pre_wrap_hooks`` entry
    (``model_cfg.pre_wrap_hooks.append(keep_output_layer_fp32)``) for models that keep
    megatron-core's class (the output-processor recipe). ``attach_vocab_parallel_loss`` and
    ``wrap_model_provider`` call it under ``--vocab-parallel-loss-fp32-head``. Chunks without an
    output layer (earlier pipeline stages) are left as they are. Idempotent.
    """
    if isinstance(model, (list, tuple)):
        for chunk in model:
            keep_output_layer_fp32(chunk)
        return model
    inner = model
    while not hasattr(inner, "share_embeddings_and_output_weights") and isinstance(
            getattr(inner, "module", None), torch.nn.Module):
        inner = inner.module
    layer = getattr(inner, "output_layer", None)
    if layer is None or not getattr(inner, "post_process", True):
        return model
    _check(inner, layer)
    if not isinstance(layer, Fp32OutputLayerMixin):
        cls = type(layer)
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            sub = type(f"Fp32{cls.__name__}", (Fp32OutputLayerMixin, cls), {})
            _SUBCLASSES[cls] = sub
        layer.__class__ = sub
    for param in layer.parameters(recurse=False):
        if param.dtype in _SIXTEEN_BIT:
            param.data = param.data.float()
    return model


def _check(model: Any, layer: Any) -> None:
    _compat.require_megatron()
    from megatron.core.tensor_parallel import ColumnParallelLinear

    if getattr(model, "share_embeddings_and_output_weights", False):
        raise ValueError(
            f"{FLAG} keeps the output layer's weight fp32, but this model ties it to the input "
            f"embedding (share_embeddings_and_output_weights): add --untie-embeddings-and-output-weights "
            f"(share_embeddings_and_output_weights=False), or drop {FLAG}")
    if not isinstance(layer, ColumnParallelLinear):
        raise TypeError(f"{FLAG} supports megatron-core's ColumnParallelLinear output layer, "
                        f"not {type(layer).__name__}")
    if any(hasattr(p, "main_grad") for p in layer.parameters(recurse=False)):
        raise RuntimeError(
            f"{FLAG}: the output layer must be kept fp32 before DDP wraps the model (its grad "
            f"buffers are laid out by dtype): use a model provider or a pre_wrap_hooks entry")


def check_fp32_weight(weight: torch.Tensor, what: str) -> None:
    """Raise unless the output weight is fp32 (``fp32_head``: it was kept fp32)."""
    if weight.dtype != torch.float32:
        raise RuntimeError(
            f"{FLAG}: {what} got a {weight.dtype} output weight; keep it fp32 before Float16Module "
            f"converts the model: model_cfg.pre_wrap_hooks.append(keep_output_layer_fp32) "
            f"(vocab_parallel_loss.megatron), or attach_vocab_parallel_loss / wrap_model_provider")
