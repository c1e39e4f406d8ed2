"""Exact vocab-parallel cross entropy for tensor-parallel language-model training."""

from .cross_entropy import cross_entropy, parallel_cross_entropy, vocab_parallel_cross_entropy
from .linear_cross_entropy import linear_cross_entropy
from .module import VocabParallelCrossEntropy
from .module_linear import VocabParallelLinearCrossEntropy

__all__ = [
    "VocabParallelCrossEntropy",
    "VocabParallelLinearCrossEntropy",
    "cross_entropy",
    "linear_cross_entropy",
    "parallel_cross_entropy",
    "vocab_parallel_cross_entropy",
]
__version__ = "0.1.0"
