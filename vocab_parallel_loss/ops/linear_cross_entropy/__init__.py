"""The loss from hidden states and classifier rows without the logits: ``contract`` (checks and
options) -> ``function`` (backend and strategy chosen per call, the autograd Function); the
strategy and the compiled checks are the fused linear engine's (``ops.fused_linear``)."""

from .function import loss

__all__ = ["loss"]
