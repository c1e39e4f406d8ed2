"""verl's ``linear_cross_entropy`` signature over ``linear_token_logprobs``."""

from __future__ import annotations

import torch

from .. import checks, linear_token_logprobs

_REDUCTIONS = ("none", "sum", "mean")


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
                         dist_process_group=None, *, fp32_precision="fp32",
                         batch_invariant=False):
    """``(log_probs, entropy)`` of ``labels`` under ``softmax(hidden @ weight.T / temperature)``.

    ``hidden`` is ``(..., H)`` (flattened to tokens), ``weight`` this rank's vocabulary shard of
    the output layer, ``labels`` the token ids (every label is a real token: no ignore index).
    Both outputs are fp32 of shape ``(num_tokens,)``; ``reduction="sum"``/``"mean"`` reduces
    the log-probs over the tokens (the entropy stays per token), as verl does. ``temperature``
    as ``linear_token_logprobs`` takes it: a float <= 0 raises, a per-token tensor (shaped like
    ``labels``, flattened with them) gives NaN where an entry is not finite and > 0.
    An fp32 ``weight`` (an fp32 LM head) may take bf16 or fp16 ``hidden`` as they are;
    ``fp32_precision`` as for ``linear_token_logprobs``.
    ``batch_invariant=True`` (keyword only; verl's call passes its six arguments, so bind it
    with ``functools.partial`` where verl's function is replaced): each token's log-prob and
    entropy are the same bits in any batch (``linear_token_logprobs``).
    """
    if not isinstance(reduction, str) or reduction.lower() not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    checks.check_group(dist_process_group, "dist_process_group")
    h = hidden.reshape(-1, hidden.shape[-1])
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 1:
        if temperature.shape != labels.shape:
            raise ValueError(f"temperature: a per-token tensor is shaped like labels "
                             f"{tuple(labels.shape)}, got {tuple(temperature.shape)}")
        temperature = temperature.reshape(-1)  # token order of the flattened labels
    out = linear_token_logprobs(h, weight, labels.reshape(-1), tp_group=dist_process_group,
                                temperature=temperature, ignore_index=-(2**63),
                                return_entropy=True, fp32_precision=fp32_precision,
                                batch_invariant=batch_invariant)
    log_probs = out.log_probs
    if reduction.lower() == "sum":
        log_probs = log_probs.sum()
    elif reduction.lower() == "mean":
        log_probs = log_probs.mean()
    return log_probs, out.entropy
