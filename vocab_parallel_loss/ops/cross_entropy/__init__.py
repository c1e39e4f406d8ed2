"""The loss over vocabulary-sharded logits: ``contract`` (checks and options) -> ``function``
(the eager autograd Function, the backend chosen per call signature) or ``compiled`` (the
``torch.library`` ops traced by torch.compile); ``steps`` is the forward and backward both run."""

from .function import log_sum_exp, loss

__all__ = ["log_sum_exp", "loss"]
