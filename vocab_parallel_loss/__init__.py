"""Exact vocab-parallel cross entropy for tensor-parallel language-model training."""

from .cross_entropy import cross_entropy, parallel_cross_entropy, vocab_parallel_cross_entropy
from .module import VocabParallelCrossEntropy

__all__ = [
    "VocabParallelCrossEntropy",
    "cross_entropy",
    "parallel_cross_entropy",
    "vocab_parallel_cross_entropy",
]
__version__ = "0.1.0"
