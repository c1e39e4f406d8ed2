"""A megatron-core ``GPTModel.forward(..., output_processor=...)`` hook (megatron-core >= 0.18):
per-token log-probs and entropy straight from the decoder's hidden states."""

from __future__ import annotations

from .. import linear_token_logprobs
from .. import accumulates_into_main_grad


def output_processor(*, hidden_states, output_layer, output_weight=None, labels=None,
                     context=None, config=None, **_):
    """Return ``{"log_probs": [b, s], "entropy": [b, s]}`` for ``labels`` ``[b, s]``.

    ``context`` may be a dict with ``temperature`` (float or ``[b, s]`` tensor, default 1.0;
    ``linear_token_logprobs``' rule: a float <= 0 raises, a tensor's unusable entries give NaN),
    ``ignore_index`` (default -100), ``memory_budget`` (bytes, ``linear_token_logprobs``'s) and
    ``fp32_precision`` (``"fp32"`` default, or ``"tf32"``: the products of an fp32 output weight).
    An fp32 output weight (an fp32 LM head, kept fp32 through Float16Module by
    ``vocab_parallel_loss.megatron.keep_output_layer_fp32``) takes the 16-bit hidden states as
    they are.
    ``batch_invariant`` (default False: ``linear_token_logprobs``', each token's outputs the
    same bits in any batch).
    The hidden states arrive ``[s, b, h]`` (sequence-sharded under sequence parallelism); the
    classifier is the output layer's weight shard (or the shared embedding weight that
    megatron-core passes as ``output_weight``). Under the config's
    ``gradient_accumulation_fusion``, with a ``main_grad`` on the weight (DDP's), the weight's
    gradient is added into it, as the output layer would add it. Any scaling megatron-core
    applies to the logits (MuP's ``mup_output_mult`` under ``use_mup``) applies here too.
    """
    if labels is None:
        raise ValueError("output_processor needs labels: the log-probs are of the label tokens")
    ctx = context or {}
    weight = output_weight if output_weight is not None else output_layer.weight
    bias = getattr(output_layer, "bias", None) if output_weight is None else None
    group = getattr(output_layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state  # noqa: PLC0415 - only with megatron-core

        group = parallel_state.get_tensor_model_parallel_group()
    from ..megatron._compat import output_logit_scale  # noqa: PLC0415 - only with megatron-core

    sp = bool(getattr(config, "sequence_parallel", False))
    temperature = ctx.get("temperature", 1.0)
    if hasattr(temperature, "dim") and temperature.dim() == 2:
        temperature = temperature.t()  # [b, s] -> [s, b], the hidden states' order
    out = linear_token_logprobs(hidden_states, weight, labels.t(), bias, tp_group=group,
                                sequence_parallel=sp, temperature=temperature,
                                ignore_index=ctx.get("ignore_index", -100), return_entropy=True,
                                memory_budget=ctx.get("memory_budget"),
                                batch_invariant=ctx.get("batch_invariant", False),
                                logit_scale=output_logit_scale(config),
                                fp32_precision=ctx.get("fp32_precision", "fp32"),
                                gradient_accumulation_fusion=accumulates_into_main_grad(
                                    config, weight))
    return {"log_probs": out.log_probs.t(), "entropy": out.entropy.t()}
