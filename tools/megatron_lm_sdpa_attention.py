"""megatron-core's local GPT layer with its core attention computed by PyTorch's
``scaled_dot_product_attention`` (flash, memory-efficient or cuDNN kernels; never the math
fallback on a GPU), for long sequences without TransformerEngine:

    pretrain_gpt.py ... --transformer-impl local --spec megatron_lm_sdpa_attention layer_spec

(this file's folder on PYTHONPATH; tools/megatron_lm_long_context.py copies it next to its
``sitecustomize``). Megatron-LM's ``--spec MODULE NAME`` takes ``MODULE.NAME`` as the layer spec.

Why: without TransformerEngine megatron-core's attention is ``DotProductAttention``, which
materializes the ``[b * heads, s, s]`` scores and probabilities (bf16, plus a dropout mask): 32
GiB per buffer at s = 32768 with 16 heads, so every loss path runs out of memory near s = 32K
whatever the loss holds. The kernels here keep O(s) memory (the output and fp32 row statistics).

The module takes what megatron-core passes its core attention (``[s, b, heads, head dim]``
query, key and value; the mask type) and returns ``[s, b, heads * head dim]``. Causal layers
use the kernels' own causal mask and ignore a data loader's mask (pass
``--no-create-attention-mask-in-dataloader``: a ``[b, 1, s, s]`` mask is s^2 bytes); other
mask types take the given mask (Megatron's True = masked out). No context parallelism, packed
sequences, attention bias, sliding window or softmax offset: they raise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

try:  # the kernel choice: torch >= 2.3
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
except ImportError:  # pragma: no cover
    sdpa_kernel = None


class SdpaCoreAttention(MegatronModule):
    """Core attention through ``F.scaled_dot_product_attention`` (module docstring)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SdpaCoreAttention: no context parallelism")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SdpaCoreAttention: no sliding-window attention")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("SdpaCoreAttention: vanilla softmax only")
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        # megatron-core's query-key layer scaling divides the scale by the layer number and
        # multiplies the scores back before the softmax: the same attention
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaCoreAttention: no packed sequences or attention bias")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        sq, b, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d] views
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # Megatron: True = masked out; SDPA: True = attend
        kwargs = dict(attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
                      scale=self.softmax_scale)
        if k.shape[1] != heads:
            kwargs["enable_gqa"] = True
        if q.is_cuda and sdpa_kernel is not None:
            with sdpa_kernel(_GPU_BACKENDS):
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


def _spec():
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec


#: The layer spec ``--spec megatron_lm_sdpa_attention layer_spec`` names.
layer_spec = _spec()
