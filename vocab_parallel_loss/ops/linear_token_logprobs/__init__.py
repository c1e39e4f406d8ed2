"""Per-token log-probs and entropy from hidden states without the logits: ``contract`` (its
checks beyond ``token_logprobs``'s) -> ``function`` (backend and strategy, the autograd
Function)."""

from .function import logprobs

__all__ = ["logprobs"]
