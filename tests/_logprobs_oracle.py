"""fp64 oracle of the per-token log-prob, entropy and argmax over the full vocabulary."""

import torch


def oracle(z, target, temperature=1.0, ignore_index=-100, softcap=None, scale=1.0,
           valid=None):
    """``z``: raw logits (..., V) of the whole vocabulary (columns past ``valid`` are padding)."""
    z = z.double()
    if valid is not None:
        z = z[..., :valid]
    y = z * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    temp = temperature.double()[..., None] if isinstance(temperature, torch.Tensor) else temperature
    x = y / temp
    ls = torch.log_softmax(x, dim=-1)
    t = target.long()
    ignored = t == ignore_index
    idx = torch.where(ignored, torch.zeros_like(t), t).clamp(0, x.shape[-1] - 1)
    lp = ls.gather(-1, idx[..., None])[..., 0]
    p = ls.exp()
    # 0 log 0 = 0. The log is masked before the product: a where around p * ls would still
    # differentiate that product, 0 * -inf, into NaN at masked (-inf) columns
    ent = -(p * torch.where(p > 0, ls, torch.zeros_like(ls))).sum(-1)
    zero = torch.zeros((), dtype=torch.float64)
    return torch.where(ignored, zero, lp), torch.where(ignored, zero, ent), x.argmax(-1)


#: tolerance of the log-probs and entropy (relative) per input dtype
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}


def logprob_grads(outputs, inputs, g_lp, g_ent):
    """Gradients of ``inputs`` under upstream gradients ``g_lp`` (log-probs), ``g_ent`` (entropy)."""
    lp, ent = outputs
    return torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), inputs)
