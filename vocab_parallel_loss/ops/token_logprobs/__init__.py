"""Per-token log-probs and entropy from vocabulary-sharded logits: ``contract`` (checks, options,
output type) -> ``function`` (the row backend chosen per call, the autograd Function)."""

from .function import logprobs

__all__ = ["logprobs"]
