"""Triton backend of the fused linear cross entropy (no autograd, no torch.distributed here).

The loss from hidden states ``e (N, H)`` and this rank's classifier rows ``c (V, H)`` without
storing the ``(N, V)`` logits. The autograd layer (``autograd/linear.py``) calls these host
functions; the files hold one idea each:

``config.py``  ``LCEConfig``, the per-device tile tables and ``default_config``
``fused.py``   the ``tl.dot`` kernels that recompute logits tiles: forward statistics
               (``forward_stats``) and dlogits with the gradient GEMMs (``backward``), 8NHV
``gemm.py``    the gradient GEMMs with fp32 accumulation (cuBLAS or a Triton GEMM)
``gated.py``   kernels that a device flag leaves out (the exact fallback of the gradients
               formed in forward for a loss mask)
``rounding.py`` an fp32 accumulator, scaled by the upstream gradient, rounded once into the
               output dtype (the gradients formed in forward)
``scales.py``  the per-row powers of two that bring an fp32 head's operands into the range of
               the fp16 parts of its split products (``common.dot``)
``saved.py``   the saved-tiles strategy: the forward saves the logits tiles, backward turns
               them into dlogits in place and runs two GEMMs, 6NHV; the same tiles a row
               chunk at a time give scalar losses their gradients in forward
``common.py``  helpers the kernel files share, and ``LogprobArgs``: every kernel above also runs
               in a log-prob mode (``ops/linear_token_logprobs``)

To override the tile configuration, set ``config.OVERRIDE_CONFIG`` (``default_config`` reads it
there) or ``VPL_LCE_CONFIG``.
"""

from . import config
from .common import LogprobArgs
from .config import AMPERE_CONFIG, HOPPER_CONFIG, INTERPRET_CONFIG, LCEConfig, default_config
from .fused import backward, forward_split, forward_stats, invariant_tiles, parts_bytes
from .gated import zero_unless
from .gemm import gemm_acc, gemm_store
from .rounding import scaled_round
from .saved import (SavedTiles, backward_saved, gif_chunk_rows, rows_of,
                    saved_bytes, saved_dz_inplace, saved_tiles)

#: Backend capabilities (``backends.LinearBackend``)
NAME = "triton"
TRACEABLE = False
STRATEGIES = ("saved", "grad_in_forward", "recompute")

__all__ = [
    "NAME", "STRATEGIES", "TRACEABLE",
    "AMPERE_CONFIG", "HOPPER_CONFIG", "INTERPRET_CONFIG", "LCEConfig", "LogprobArgs", "SavedTiles",
    "backward",
    "backward_saved", "rows_of", "saved_bytes", "saved_dz_inplace", "saved_tiles",
    "config", "default_config", "forward_split", "forward_stats", "gemm_acc", "gemm_store",
    "parts_bytes",
    "gif_chunk_rows", "invariant_tiles", "scaled_round", "zero_unless",
]
