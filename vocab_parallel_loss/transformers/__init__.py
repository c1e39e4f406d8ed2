"""Hugging Face transformers integration: causal LMs whose loss never materialises the logits.

    import vocab_parallel_loss.transformers as vpl_hf

    model = AutoModelForCausalLM.from_pretrained(...)
    vpl_hf.patch(model)             # this instance only
    vpl_hf.patch("llama")           # or: every LlamaForCausalLM, existing or loaded later

With ``labels`` the loss comes from ``linear_cross_entropy`` on the last hidden states and
``lm_head.weight`` (same value as transformers' own loss, ``num_items_in_batch`` included) and
``outputs.logits`` is ``None``; without labels the model behaves exactly as before.
"""

from ._loss import causal_lm_loss
from ._patch import SUPPORTED_MODEL_TYPES, PatchOptions, is_patched, patch, unpatch

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "PatchOptions",
    "causal_lm_loss",
    "is_patched",
    "patch",
    "unpatch",
]
