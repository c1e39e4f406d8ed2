"""Exact vocab-parallel cross entropy for tensor-parallel language-model training."""

from .dropins import parallel_cross_entropy, vocab_parallel_cross_entropy
from .functional import cross_entropy, linear_cross_entropy
from .modules import VocabParallelCrossEntropy, VocabParallelLinearCrossEntropy

__all__ = [
    "VocabParallelCrossEntropy",
    "VocabParallelLinearCrossEntropy",
    "cross_entropy",
    "linear_cross_entropy",
    "parallel_cross_entropy",
    "vocab_parallel_cross_entropy",
]
__version__ = "0.1.0"
