#!/usr/bin/env python
"""Write the README's Megatron-LM recipes into a copy of Megatron-LM's own ``pretrain_gpt.py``:
the few lines a user adds, inserted where a user would add them. Nothing else changes.

    python tools/megatron_lm_recipes.py MEGATRON_LM/pretrain_gpt.py RECIPE > pretrain_gpt_RECIPE.py

The CPU tests (tests/integrations/megatron/test_megatron_lm.py) and the GPU runs (tools/megatron_lm_h200.py)
run the files this writes. Recipes (``RECIPES``), by the ``pretrain_gpt.py`` generation they fit:

* ``native``: the file as shipped (megatron-core's loss; ``--cross-entropy-loss-fusion`` for its
  fused one).
* ``provider`` (Megatron-LM <= 0.17, ``pretrain(..., extra_args_provider=...)``; and 0.18, where
  ``parse_and_validate_args`` takes the flags and ``pretrain`` the model provider as its third
  positional argument): the flags through ``with_vocab_parallel_loss_args``, the model provider
  wrapped with ``wrap_model_provider`` where it stands.
* ``container_provider`` (``parse_and_validate_args`` + config container, the 0.18 layout, written
  on a 0.19+ file): the flags; the container built without the model config, so ``pretrain``
  calls the wrapped model provider it is given.
* ``pre_wrap_hook`` (0.19+ and main): the flags; ``attach_vocab_parallel_loss`` appended to
  ``model_cfg.pre_wrap_hooks``.
* ``output_processor`` (0.19+ and main): the flags; ``forward_step`` passes
  ``output_processor=VocabParallelLossOutputProcessor()`` to the model.
* ``flags_only`` (either layout: the flags, no model wiring) and ``ignored_provider`` (0.19+: a
  wrapped provider given to ``pretrain`` next to a model config, which ``pretrain`` never calls):
  wrong wirings, on which the guard must fire.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

IMPORT = ("from vocab_parallel_loss.megatron import (VocabParallelLossOutputProcessor, attach_vocab_parallel_loss,\n"
          "                                          with_vocab_parallel_loss_args, wrap_model_provider)\n")
FLAGS_OLD = "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None"
FLAGS_NEW = "extra_args_provider=with_vocab_parallel_loss_args(add_modelopt_args if has_nvidia_modelopt else None)"
PROVIDER = "partial(model_provider, gpt_builder)"
CONTAINER = "full_config = pretrain_cfg_container_from_args(args, model_cfg)"

RECIPES = ("native", "provider", "container_provider", "pre_wrap_hook", "output_processor", "flags_only",
           "ignored_provider")


class RecipeError(ValueError):
    """The file does not have the layout the recipe is written for."""


def generation(text: str) -> str:
    """``"pretrain_args"`` (``pretrain`` parses the flags, <= 0.17) or ``"config_container"`` (0.18+)."""
    return "config_container" if "parse_and_validate_args(" in _main_block(text) else "pretrain_args"


def _main_block(text: str) -> str:
    at = text.find('if __name__ == "__main__":')
    if at < 0:
        raise RecipeError('no `if __name__ == "__main__":` block')
    return text[at:]


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise RecipeError(f"expected exactly one `{old}` in {where}, found {text.count(old)}")
    return text.replace(old, new)


def _line_indent(text: str, needle: str) -> str:
    line = next((ln for ln in text.splitlines() if needle in ln), None)
    if line is None:
        raise RecipeError(f"no line with `{needle}`")
    return re.match(r"\s*", line).group(0)


def apply(text: str, recipe: str) -> str:
    """``text`` (a ``pretrain_gpt.py``) with ``recipe`` written in."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    if recipe == "native":
        return text
    gen = generation(text)
    wants = {"provider": "pretrain_args", "flags_only": gen}.get(recipe, "config_container")
    if recipe == "provider" and gen == "config_container" and PROVIDER in _main_block(text):
        wants = gen  # 0.18: pretrain(full_config, datasets provider, partial(model_provider, ...), ...)
    if gen != wants:
        raise RecipeError(f"recipe {recipe!r} is written for a {wants} pretrain_gpt.py, this one is {gen}")
    head, main = text[: len(text) - len(_main_block(text))], _main_block(text)
    # The import, after the file's own imports (the model provider's is the last in both layouts).
    head = _replace_once(head, "from model_provider import model_provider\n",
                         "from model_provider import model_provider\n" + IMPORT, "the imports")
    main = _replace_once(main, FLAGS_OLD, FLAGS_NEW, "the __main__ block")
    if recipe == "provider":
        main = _replace_once(main, PROVIDER, f"wrap_model_provider({PROVIDER})", "the __main__ block")
    elif recipe == "pre_wrap_hook":
        indent = _line_indent(main, CONTAINER)
        main = _replace_once(main, indent + CONTAINER,
                             f"{indent}model_cfg.pre_wrap_hooks.append(attach_vocab_parallel_loss)\n{indent}{CONTAINER}",
                             "the __main__ block")
    elif recipe in ("container_provider", "ignored_provider"):
        if recipe == "container_provider":
            main = _replace_once(main, CONTAINER, "full_config = pretrain_cfg_container_from_args(args, None)",
                                 "the __main__ block")
        indent = _line_indent(main, "forward_step,")
        main = _replace_once(main, f"{indent}forward_step,\n",
                             f"{indent}forward_step,\n{indent}model_provider=wrap_model_provider({PROVIDER}),\n",
                             "the pretrain call")
    elif recipe == "output_processor":
        head = head.replace(IMPORT, IMPORT + "_VPL_OUTPUT_PROCESSOR = VocabParallelLossOutputProcessor()\n")
        call = head.find("output_tensor = model(")
        if call < 0:
            raise RecipeError("no `output_tensor = model(` in forward_step")
        mask = head.find("loss_mask=loss_mask,\n", call)
        if mask < 0:
            raise RecipeError("no `loss_mask=loss_mask,` in forward_step's model call")
        indent = head[head.rfind("\n", 0, mask) + 1: mask]
        end = mask + len("loss_mask=loss_mask,\n")
        head = head[:end] + f"{indent}output_processor=_VPL_OUTPUT_PROCESSOR,\n" + head[end:]
    return head + main


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pretrain_gpt", type=Path)
    p.add_argument("recipe", choices=RECIPES)
    a = p.parse_args(argv)
    sys.stdout.write(apply(a.pretrain_gpt.read_text(), a.recipe))


if __name__ == "__main__":
    main()
