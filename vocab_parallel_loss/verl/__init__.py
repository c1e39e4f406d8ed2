"""Drop-ins for verl's fused log-prob/entropy entry points, computed by this package.

``linear_cross_entropy`` has the signature of ``verl.utils.kernel.linear_cross_entropy``:
``(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None)`` returning
``(log_probs, entropy)`` per token (flattened), the log-probs summed or averaged over tokens for
``reduction="sum"``/``"mean"``. ``output_processor`` is a megatron-core (>= 0.18)
``GPTModel.forward(..., output_processor=...)`` hook that returns the same from the decoder's
hidden states without building the logits.
"""

from ._linear import linear_cross_entropy
from ._megatron import output_processor

__all__ = ["linear_cross_entropy", "output_processor"]
