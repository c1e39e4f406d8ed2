"""A GPT layer spec that runs anywhere torch runs (CPU included): megatron-core's local spec with
its core attention swapped for ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's ``DotProductAttention`` takes its score buffer from a CUDA memory pool and forks
the CUDA RNG tracker, so it cannot run on CPU; TransformerEngine is often not installed. This is
a layer spec, chosen by the caller: nothing in megatron-core is patched.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Optional

import torch.nn.functional as F

from . import _compat

_compat.require_megatron()
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402


class SDPACoreAttention(MegatronModule):
    """Core attention ``[s, b, np, hn] -> [s, b, np * hn]`` with causal masking via SDPA.

    Takes megatron-core's core-attention constructor arguments (they vary across releases).
    Supports causal and no-mask attention, grouped query attention, no dropout.
    """

    def __init__(
        self,
        config,
        layer_number: int = 1,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        attention_type: str = "self",
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        **kwargs: Any,
    ):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError("SDPACoreAttention supports attention_dropout=0 only")

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs: Any):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPACoreAttention supports neither packed sequences nor attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        if not causal and mask_type != AttnMaskType.no_mask:
            raise ValueError(f"SDPACoreAttention supports causal and no_mask only, got {mask_type}")
        s, b, nq, hn = query.shape
        q, k, v = (t.permute(1, 2, 0, 3).to(value.dtype) for t in (query, key, value))  # [b, n, s, hn]
        if k.size(1) != nq:  # grouped query attention
            k = k.repeat_interleave(nq // k.size(1), dim=1)
            v = v.repeat_interleave(nq // v.size(1), dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, nq * hn)


def sdpa_gpt_layer_spec(**kwargs: Any):
    """``get_gpt_layer_local_spec(**kwargs)`` with :class:`SDPACoreAttention` as core attention."""
    spec = copy.deepcopy(get_gpt_layer_local_spec(**_compat.filter_kwargs(get_gpt_layer_local_spec, kwargs)))
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise TypeError("this megatron-core's local GPT layer spec has no self_attention core_attention")
    try:
        attention.submodules.core_attention = SDPACoreAttention
    except dataclasses.FrozenInstanceError:  # should a release freeze its spec dataclasses
        attention.submodules = dataclasses.replace(attention.submodules, core_attention=SDPACoreAttention)
    return spec
