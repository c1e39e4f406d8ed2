"""Patch Hugging Face causal-LM forwards so that the loss never materialises the logits.

How: the patched forward runs the model's *own* forward with ``labels=None`` while the LM head is
swapped, for that call only, for a stub that records its input (the final hidden states, after
any ``logits_to_keep`` slicing) and returns an empty tensor. Everything model-specific (argument
names, caches, masks, deprecations, output classes) stays the original code of the installed
transformers version; only the loss is ours: ``linear_cross_entropy`` on those hidden states and
``lm_head.weight``, with the shift, ignore index, ``num_items_in_batch`` and (Gemma 2-4, 3n) final
logit softcapping that transformers uses, the logit scale of Granite and Cohere (applied to the
hidden states), and a mixture-of-experts model's router loss where the original adds it. The
output is the original output class with ``loss`` set and ``logits=None``.

Without labels (generation, evaluation without a loss) the original forward is called unchanged.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import types
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from .. import checks
from ._loss import REDUCTIONS, causal_lm_loss

# model_type -> (transformers.models submodule, causal-LM class names)
_FAMILIES = {
    "gemma": ("gemma", ("GemmaForCausalLM",)),
    "llama": ("llama", ("LlamaForCausalLM",)),
    "mistral": ("mistral", ("MistralForCausalLM",)),
    "phi3": ("phi3", ("Phi3ForCausalLM",)),
    "gemma2": ("gemma2", ("Gemma2ForCausalLM",)),
    "gemma3": ("gemma3", ("Gemma3ForCausalLM",)),  # the text causal LM only
    "gemma3_text": ("gemma3", ("Gemma3ForCausalLM",)),
    "qwen2": ("qwen2", ("Qwen2ForCausalLM",)),
    "qwen3": ("qwen3", ("Qwen3ForCausalLM",)),
    "olmo": ("olmo", ("OlmoForCausalLM",)),
    "olmo2": ("olmo2", ("Olmo2ForCausalLM",)),
    "phi": ("phi", ("PhiForCausalLM",)),  # its LM head has a bias
    "starcoder2": ("starcoder2", ("Starcoder2ForCausalLM",)),
    "glm4": ("glm4", ("Glm4ForCausalLM",)),
    "granite": ("granite", ("GraniteForCausalLM",)),  # logits scaled: _LOGIT_SCALE
    "cohere": ("cohere", ("CohereForCausalLM",)),  # logits scaled: _LOGIT_SCALE
    # mixture of experts: the router's load-balancing loss is added as the original adds it
    "mixtral": ("mixtral", ("MixtralForCausalLM",)),
    "qwen2_moe": ("qwen2_moe", ("Qwen2MoeForCausalLM",)),
    "qwen3_moe": ("qwen3_moe", ("Qwen3MoeForCausalLM",)),
    # families added with transformers 5.x (several exist in 4.51 too): the same mechanism
    "llama4": ("llama4", ("Llama4ForCausalLM",)),  # the text causal LM only
    "llama4_text": ("llama4", ("Llama4ForCausalLM",)),
    "deepseek_v3": ("deepseek_v3", ("DeepseekV3ForCausalLM",)),
    "gemma3n": ("gemma3n", ("Gemma3nForCausalLM",)),  # the text causal LM only; softcapped
    "gemma3n_text": ("gemma3n", ("Gemma3nForCausalLM",)),
    "qwen3_next": ("qwen3_next", ("Qwen3NextForCausalLM",)),
    "qwen3_5": ("qwen3_5", ("Qwen3_5ForCausalLM",)),  # the text causal LM only
    "qwen3_5_text": ("qwen3_5", ("Qwen3_5ForCausalLM",)),
    "qwen3_5_moe": ("qwen3_5_moe", ("Qwen3_5MoeForCausalLM",)),
    "qwen3_5_moe_text": ("qwen3_5_moe", ("Qwen3_5MoeForCausalLM",)),
    "gpt_oss": ("gpt_oss", ("GptOssForCausalLM",)),
    "glm4_moe": ("glm4_moe", ("Glm4MoeForCausalLM",)),
    "olmo3": ("olmo3", ("Olmo3ForCausalLM",)),
    "gemma4": ("gemma4", ("Gemma4ForCausalLM",)),  # the text causal LM only; softcapped
    "gemma4_text": ("gemma4", ("Gemma4ForCausalLM",)),
    "deepseek_v2": ("deepseek_v2", ("DeepseekV2ForCausalLM",)),
    "olmoe": ("olmoe", ("OlmoeForCausalLM",)),
    "phimoe": ("phimoe", ("PhimoeForCausalLM",)),
    "granitemoe": ("granitemoe", ("GraniteMoeForCausalLM",)),  # logits scaled: _LOGIT_SCALE
    "cohere2": ("cohere2", ("Cohere2ForCausalLM",)),  # logits scaled: _LOGIT_SCALE
    "smollm3": ("smollm3", ("SmolLM3ForCausalLM",)),
    "ministral": ("ministral", ("MinistralForCausalLM",)),
    "exaone4": ("exaone4", ("Exaone4ForCausalLM",)),
    "ernie4_5_moe": ("ernie4_5_moe", ("Ernie4_5_MoeForCausalLM",)),
    "seed_oss": ("seed_oss", ("SeedOssForCausalLM",)),
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))

# model_type -> the factor its forward multiplies the LM head's output by before the loss; the
# loss then comes from the hidden states (and bias) times it, the same logits
_LOGIT_SCALE = {
    "granite": lambda model: 1.0 / model.config.logits_scaling,
    "granitemoe": lambda model: 1.0 / model.config.logits_scaling,
    "cohere": lambda model: model.logit_scale,
    "cohere2": lambda model: model.logit_scale,
}

_MISSING = object()
_WRAPPER_FLAG = "_vocab_parallel_loss_patch"


@dataclass(frozen=True)
class PatchOptions:
    reduction: str = "mean"
    impl: str = "auto"
    train_only: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    memory_budget: Optional[float] = None
    fp32_precision: str = "fp32"


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"vocab_parallel_loss.transformers.patch does not support {what}; supported model types: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (their *ForCausalLM classes)"
    )


def _classes_for(model_type: str) -> list:
    module_name, class_names = _FAMILIES[model_type]
    try:
        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    except ImportError as exc:
        raise ValueError(
            f"model type {model_type!r} is not available in the installed transformers: {exc}"
        ) from exc
    return [getattr(module, name) for name in class_names if hasattr(module, name)]


def _is_supported(cls) -> bool:
    """Whether ``cls`` is (or subclasses) a supported causal-LM class, found by module and name so
    that no other family's modeling module is imported."""
    for klass in cls.__mro__:
        for module_name, class_names in _FAMILIES.values():
            if (klass.__name__ in class_names
                    and klass.__module__ == f"transformers.models.{module_name}.modeling_{module_name}"):
                return True
    return False


def _unwrap(fn):
    """The forward that was there before our patch (ours carries it)."""
    while getattr(fn, _WRAPPER_FLAG, None) is not None:
        fn = getattr(fn, _WRAPPER_FLAG)[0]
    return fn


def _positional_names(fn) -> tuple[list, bool]:
    """Names of the parameters that can be given positionally (after ``self``); has **kwargs."""
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    names = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        else:
            break
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    accepts_return_dict = has_var_kw or any(p.name == "return_dict" for p in params)
    return names, accepts_return_dict


def _usable_head(lm_head) -> bool:
    if not isinstance(lm_head, nn.Linear):  # e.g. a PEFT LoRA layer on the head: fall back
        return False
    w = lm_head.weight
    # not: quantized, offloaded (meta) or partitioned (DeepSpeed ZeRO-3 outside the head's forward)
    return w.is_floating_point() and w.device.type != "meta" and w.dim() == 2 and w.numel() > 0


@functools.lru_cache(maxsize=None)
def _warn_once(msg: str) -> None:
    warnings.warn(msg, stacklevel=3)


def _make_forward(original: Callable, signature_of: Callable, options: PatchOptions) -> Callable:
    """``original(self, *args, **kwargs)`` is the forward to defer to; ``signature_of`` names its
    parameters (the class's function, followed through decorators)."""
    names, accepts_return_dict = _positional_names(signature_of)

    @functools.wraps(signature_of)
    def forward(self, *args, **kwargs):
        if options.train_only and not self.training:
            return original(self, *args, **kwargs)
        if len(args) > len(names):
            return original(self, *args, **kwargs)
        call = dict(zip(names, args))
        if any(k in call for k in kwargs):
            return original(self, *args, **kwargs)  # let the original raise its TypeError
        call.update(kwargs)
        labels = call.get("labels")
        shift_labels = call.get("shift_labels")
        if labels is None and shift_labels is None:
            return original(self, *args, **kwargs)
        lm_head = getattr(self, "lm_head", None)
        if not _usable_head(lm_head):
            _warn_once(
                f"vocab_parallel_loss.transformers: {type(self).__name__}.lm_head is "
                f"{type(lm_head).__name__}, not a plain floating-point nn.Linear; using the "
                "original forward (logits are materialised)"
            )
            return original(self, *args, **kwargs)

        num_items_in_batch = call.get("num_items_in_batch")
        ignore_index = call.get("ignore_index", -100)
        return_dict = call.pop("return_dict", None)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        if accepts_return_dict:
            call["return_dict"] = True
        call["labels"] = None

        captured = []

        def capture(hidden_states, *unused_args, **unused_kwargs):
            captured.append(hidden_states)
            return hidden_states.new_empty(hidden_states.shape[:-1] + (0,))

        previous = lm_head.__dict__.get("forward", _MISSING)  # e.g. an accelerate hook
        lm_head.forward = capture
        try:
            out = original(self, **call)
        finally:
            if previous is _MISSING:
                del lm_head.forward
            else:
                lm_head.forward = previous
        if len(captured) != 1:
            raise RuntimeError(
                f"vocab_parallel_loss.transformers: {type(self).__name__}.forward called lm_head "
                f"{len(captured)} times, expected once; unpatch this model"
            )

        hidden, bias = _scaled_head_inputs(self, captured[0], lm_head.bias)
        loss = causal_lm_loss(
            hidden,
            lm_head.weight,
            labels,
            bias=bias,
            shift_labels=shift_labels,
            num_items_in_batch=num_items_in_batch,
            ignore_index=ignore_index,
            softcap=getattr(self.config, "final_logit_softcapping", None),
            reduction=options.reduction,
            impl=options.impl,
            label_smoothing=options.label_smoothing,
            z_loss=options.z_loss,
            memory_budget=options.memory_budget,
            fp32_precision=options.fp32_precision,
        )
        return _with_loss(out, _plus_router_loss(self, out, loss, options.reduction), return_dict)

    setattr(forward, _WRAPPER_FLAG, (original, options))
    return forward


def _scaled_head_inputs(model, hidden, bias):
    """The LM head's input and bias times the model's logit scale (``_LOGIT_SCALE``): the same
    logits as scaling the head's output."""
    scale_of = _LOGIT_SCALE.get(getattr(model.config, "model_type", None))
    scale = 1.0 if scale_of is None else float(scale_of(model))
    if scale == 1.0:
        return hidden, bias
    return hidden * scale, None if bias is None else bias * scale


def _plus_router_loss(model, out, loss, reduction: str):
    """A mixture-of-experts model that returned its router's load-balancing loss
    (``output_router_logits``) adds ``router_aux_loss_coef`` times it to the loss when labels are
    given; the original forward ran without labels here, so that sum is made here, the same way.
    Not to per-token losses (``reduction="none"``): a scalar added to every token would count it
    once per token; it stays in ``aux_loss``."""
    if reduction == "none":
        return loss
    aux_loss = None if isinstance(out, tuple) else out.get("aux_loss")
    coef = getattr(model, "router_aux_loss_coef", None)
    if aux_loss is None or coef is None:
        return loss
    return loss + coef * aux_loss.to(loss.device)


def _with_loss(out, loss, return_dict: bool):
    """The original's output with ``loss`` set and ``logits=None``. As a tuple it has the
    original's positions: transformers leaves out the fields that are None, but keeps a slot for
    the logits it computed, so the logits' slot stays there, holding None."""
    if isinstance(out, tuple):  # a forward that ignored return_dict=True: the stub's output
        return (loss,) + tuple(None if _is_stub_output(t) else t for t in out)
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    if return_dict:
        return type(out)(loss=loss, **fields)
    full = type(out)(loss=loss, logits=out.get("logits"), **fields)
    return tuple(None if k == "logits" else full[k] for k in full.keys())


def _is_stub_output(value) -> bool:
    """What the LM head stub returns (an empty last dimension), or a view of it."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape[-1] == 0


def _check_options(reduction, impl, train_only, label_smoothing, z_loss,
                   memory_budget, fp32_precision="fp32") -> PatchOptions:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    checks.check_memory_budget(memory_budget)
    checks.check_fp32_precision(fp32_precision)
    return PatchOptions(
        reduction=reduction,
        impl=impl,
        train_only=bool(train_only),
        label_smoothing=float(label_smoothing),
        z_loss=float(z_loss),
        memory_budget=memory_budget,
        fp32_precision=fp32_precision,
    )


def _base_model(model):
    """The transformers model inside a PEFT wrapper (patched in place), else the model."""
    if _is_supported(type(model)):
        return model
    get_base = getattr(model, "get_base_model", None)  # peft.PeftModel
    if callable(get_base):
        return get_base()
    return model


def patch(
    model_or_model_type,
    *,
    reduction: str = "mean",
    impl: str = "auto",
    train_only: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    memory_budget: Optional[float] = None,
    fp32_precision: str = "fp32",
):
    """Make a causal LM compute its training loss with ``linear_cross_entropy``.

    ``model_or_model_type``: a model instance (only that instance is patched; a PEFT wrapper is
    patched through its base model) or a model type string such as ``"llama"`` (the forward of
    that family's ``*ForCausalLM`` class is patched, for every model of that type, existing or
    loaded later). When ``labels`` (or ``shift_labels``) are given, the loss is computed from the
    final hidden states and ``lm_head.weight`` without materialising the logits and the output's
    ``logits`` is ``None``; otherwise the original forward runs unchanged.

    ``reduction``: ``"mean"`` matches transformers exactly (mean over non-ignored tokens, or their
    sum divided by ``num_items_in_batch`` when the ``Trainer`` passes it); ``"sum"``; ``"none"``
    (per-token losses in the shape of the shifted labels). ``impl`` is passed to
    ``linear_cross_entropy`` (``"auto"``, ``"triton"``, ``"torch"``). ``train_only=True`` keeps the
    original forward (with logits) in eval mode, e.g. for metrics that need logits.
    ``label_smoothing`` and ``z_loss`` are extras transformers' loss does not have (0 = off).
    ``memory_budget``: ``linear_cross_entropy``'s (bytes; None: its default, 2 GiB).
    An fp32 ``lm_head`` in a bf16 or fp16 model (``model.lm_head.float()``: an fp32 LM head)
    takes the hidden states as they are, with fp32-class products (``fp32_precision="fp32"``)
    or TF32 ones (``"tf32"``), without an fp32 copy of them.

    Returns the patched model (or, for a type string, the patched class).
    """
    options = _check_options(reduction, impl, train_only, label_smoothing, z_loss, memory_budget,
                             fp32_precision)
    if isinstance(model_or_model_type, str):
        model_type = model_or_model_type
        if model_type not in _FAMILIES:
            raise _unsupported(f"model type {model_type!r}")
        classes = _classes_for(model_type)
        if not classes:
            raise _unsupported(f"model type {model_type!r} in this transformers version")
        for cls in classes:
            original = _unwrap(cls.forward)
            cls.forward = _make_forward(original, original, options)
        return classes[0]

    model = model_or_model_type
    target = _base_model(model)
    if not isinstance(target, nn.Module):
        raise TypeError(f"patch expects a model or a model type string, got {type(model).__name__}")
    if not _is_supported(type(target)):
        model_type = getattr(getattr(target, "config", None), "model_type", None)
        raise _unsupported(f"{type(target).__name__} (model type {model_type!r})")
    class_forward = _unwrap(type(target).forward)
    previous = target.__dict__.get("forward", _MISSING)
    if previous is not _MISSING and getattr(previous, "__func__", None) is not None and getattr(
        previous.__func__, _WRAPPER_FLAG, None
    ) is not None:
        previous = getattr(previous.__func__, _WRAPPER_FLAG)[0]  # re-patch: replace our options
        original = previous
    elif previous is not _MISSING:  # an instance-level forward (e.g. an accelerate hook): keep it
        instance_forward = previous
        original = lambda self, *a, **k: instance_forward(*a, **k)  # noqa: E731
        setattr(original, "_vpl_instance_forward", instance_forward)
    else:
        original = class_forward
    target.forward = types.MethodType(_make_forward(original, class_forward, options), target)
    return model


def unpatch(model_or_model_type):
    """Undo :func:`patch` for that model instance or model type. Returns the model or class."""
    if isinstance(model_or_model_type, str):
        if model_or_model_type not in _FAMILIES:
            raise _unsupported(f"model type {model_or_model_type!r}")
        classes = _classes_for(model_or_model_type)
        for cls in classes:
            cls.forward = _unwrap(cls.forward)
        return classes[0] if classes else None
    model = model_or_model_type
    target = _base_model(model)
    current = target.__dict__.get("forward", _MISSING)
    func = getattr(current, "__func__", None)
    if current is not _MISSING and func is not None and getattr(func, _WRAPPER_FLAG, None):
        original = getattr(func, _WRAPPER_FLAG)[0]
        instance_forward = getattr(original, "_vpl_instance_forward", None)
        if instance_forward is not None:
            target.forward = instance_forward
        else:
            del target.forward
    return model


def is_patched(model_or_model_type) -> bool:
    """Whether :func:`patch` is in effect for that model instance or model type."""
    if isinstance(model_or_model_type, str):
        if model_or_model_type not in _FAMILIES:
            return False
        return any(getattr(c.forward, _WRAPPER_FLAG, None) is not None
                   for c in _classes_for(model_or_model_type))
    target = _base_model(model_or_model_type)
    fwd = getattr(target, "forward", None)
    return getattr(getattr(fwd, "__func__", fwd), _WRAPPER_FLAG, None) is not None
