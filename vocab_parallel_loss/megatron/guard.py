"""The check that ``--vocab-parallel-loss`` really trains with this package's loss.

Between parsing the flags and training, Megatron-LM calls nothing of this package but the model
wiring the user added (a wrapped model provider, a ``pre_wrap_hooks`` entry, an output processor).
When that wiring is missing or ignored (Megatron-LM 0.19 and later build the model from a
``GPTModelConfig`` and never call a model provider given to ``pretrain``), the flag would parse
and training would run with megatron-core's loss.

So adding the flags (:func:`~vocab_parallel_loss.megatron.add_vocab_parallel_loss_args`) arms a
one-shot global forward pre-hook. At the first forward of a megatron-core language model, or of a
wrapper of one (Megatron's DDP / Float16Module: ``.module`` chains), while Megatron-LM's parsed
arguments have ``--vocab-parallel-loss``, the model must compute its loss with this package, with
the flags' settings, or be given :class:`VocabParallelLossOutputProcessor` on its forward;
otherwise :class:`VocabParallelLossNotWiredError` is raised: before the model's forward runs, or
(the output-processor check of a model called without a wrapper, whose keyword arguments the
global hook cannot see) right after it, before any backward or optimizer step. The hook removes
itself at that first forward, and at the first forward of any module in a process without
Megatron-LM's arguments (or without the flag): no cost afterwards. A training loop that never
calls the model itself (megatron-core's schedule plans call its parts) leaves nothing to check:
after ``PATIENCE`` module calls the hook removes itself with a warning.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from . import _compat
from .config import VocabParallelLossConfig

_handle = None
_calls_without_model = 0
PATIENCE = 10_000  # module calls to wait for the model's own forward

RECIPES = (
    "Megatron-LM <= 0.18 (pretrain is given a model provider and calls it): "
    "pretrain(..., wrap_model_provider(partial(model_provider, gpt_builder)), ...); "
    "Megatron-LM >= 0.19 (pretrain_gpt.py builds the model from a GPTModelConfig and calls no model "
    "provider): model_cfg.pre_wrap_hooks.append(attach_vocab_parallel_loss); or pass "
    "output_processor=VocabParallelLossOutputProcessor() to the model's forward. "
    "See the Megatron section of vocab_parallel_loss's README."
)


class VocabParallelLossNotWiredError(RuntimeError):
    """``--vocab-parallel-loss`` was parsed, but the model that trains computes another loss."""


def arm() -> None:
    """Install the one-shot check (idempotent)."""
    global _handle, _calls_without_model
    if _handle is None:
        _calls_without_model = 0
        _handle = register_module_forward_pre_hook(_first_forward)


def disarm() -> None:
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None
_calls_without_model = 0
PATIENCE = 10_000  # module calls to wait for the model's own forward


def armed() -> bool:
    return _handle is not None


def _language_model(module: torch.nn.Module) -> Optional[torch.nn.Module]:
    """``module`` if it is a megatron-core language model, else the one it wraps (``.module``)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    while not isinstance(module, LanguageModule):
        module = getattr(module, "module", None)
        if not isinstance(module, torch.nn.Module):
            return None
    return module


def _first_forward(module: torch.nn.Module, _inputs: Any) -> None:
    global _calls_without_model
    args = _compat.megatron_lm_args()
    if args is None or not getattr(args, "vocab_parallel_loss", False):
        disarm()
        return None
    model = _language_model(module)
    if model is None:  # a module outside the model, or a part of it: wait for the model itself
        _calls_without_model += 1
        if _calls_without_model >= PATIENCE:
            disarm()
            warnings.warn(f"vocab_parallel_loss: no megatron-core language model was called in the first "
                          f"{PATIENCE} module calls; whether --vocab-parallel-loss is wired was not checked")
        return None
    disarm()
    check_model(model, VocabParallelLossConfig.from_args(args), running=model is module)
    return None


def check_model(model: torch.nn.Module, expected: VocabParallelLossConfig, running: bool = False) -> None:
    """Raise unless ``model`` computes its loss with this package and ``expected``'s settings.

    A model of megatron-core's own class passes only with :class:`VocabParallelLossOutputProcessor`
    on its forward: that is checked on its next forward (``running=False``) or after the one under
    way (``running=True``), from the call's keyword arguments.
    """
    from .model import VocabParallelLossMixin

    if isinstance(model, VocabParallelLossMixin):
        _check_config(model.loss_config, expected, type(model).__name__)
        return
    check = _OutputProcessorCheck(model, expected)
    if running:
        check.handle = model.register_forward_hook(check.after, with_kwargs=True)
    else:
        check.handle = model.register_forward_pre_hook(check.before, with_kwargs=True)


def _check_config(found: VocabParallelLossConfig, expected: VocabParallelLossConfig, what: str) -> None:
    if found != expected:
        raise VocabParallelLossNotWiredError(
            f"--vocab-parallel-loss was given, but {what} computes its loss with {found} while the "
            f"command line asks for {expected}: with the flags parsed, leave loss_config=None (the "
            f"flags decide) or pass the same settings.")


class _OutputProcessorCheck:
    def __init__(self, model: torch.nn.Module, expected: VocabParallelLossConfig):
        self.name = type(model).__name__
        self.expected = expected
        self.handle: Optional[Any] = None

    def before(self, _module, _args, kwargs):
        self._check(kwargs)
        return None

    def after(self, _module, _args, kwargs, _output):
        self._check(kwargs)
        return None

    def _check(self, kwargs) -> None:
        from .output_processor import VocabParallelLossOutputProcessor

        self.handle.remove()
        processor = kwargs.get("output_processor")
        if isinstance(processor, VocabParallelLossOutputProcessor):
            _check_config(processor.loss_config, self.expected, "the output processor")
            return
        raise VocabParallelLossNotWiredError(
            f"--vocab-parallel-loss was given, but the model that trains ({self.name}) computes its "
            f"loss with megatron-core's cross entropy: the flag was parsed and never wired to the "
            f"model. {RECIPES}")
