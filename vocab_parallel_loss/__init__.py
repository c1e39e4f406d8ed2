"""Exact vocab-parallel cross entropy for tensor-parallel language-model training."""

from .autograd.main_grad import requested as accumulates_into_main_grad
from .dropins import parallel_cross_entropy, vocab_parallel_cross_entropy
from .functional import (TokenLogprobs, cross_entropy, linear_cross_entropy, linear_token_logprobs,
                         token_logprobs)
from .modules import VocabParallelCrossEntropy, VocabParallelLinearCrossEntropy

__all__ = [
    "accumulates_into_main_grad",
    "TokenLogprobs",
    "VocabParallelCrossEntropy",
    "VocabParallelLinearCrossEntropy",
    "cross_entropy",
    "linear_cross_entropy",
    "linear_token_logprobs",
    "parallel_cross_entropy",
    "token_logprobs",
    "vocab_parallel_cross_entropy",
]
__version__ = "0.1.0"
