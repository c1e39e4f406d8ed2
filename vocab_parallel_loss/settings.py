"""Every environment switch the package reads, in one place, with one parse rule.

A switch is off when its value is empty, ``0``, ``false``, ``no`` or ``off`` (any case), on for any
other value, and takes its default when unset. Switches on the hot path are read once and
remembered (an environment lookup costs about a microsecond of host time); the documented moment
at which each is read is the one below.
"""

from __future__ import annotations

import functools
import json
import os

#: Run the Triton kernels on CPU tensors through Triton's interpreter (set before import).
TRITON_INTERPRET = "TRITON_INTERPRET"
#: Launch the compiled kernels through the package's remembered launches (default on).
FAST_LAUNCH = "VPL_FAST_LAUNCH"
#: Chain the launches of a reduced loss with programmatic dependent launch on Hopper (default on).
PDL = "VPL_PDL"
#: Form a reduced loss's gradient in the forward kernel on one shard (default on).
FUSED_REDUCED = "VPL_FUSED_REDUCED"
#: Raise on targets outside the vocabulary that are not the ignore index (default off; syncs).
CHECK_TARGETS = "VOCAB_PARALLEL_LOSS_CHECK_TARGETS"
#: JSON object of ``LCEConfig`` fields applied over the fused linear loss's tile configuration.
LCE_CONFIG = "VPL_LCE_CONFIG"

_OFF = ("", "0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """The switch ``name`` as a bool, by the one parse rule above; ``default`` when unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() not in _OFF


def interpreting() -> bool:
    """Whether Triton runs its kernels on the CPU (``TRITON_INTERPRET``)."""
    return flag(TRITON_INTERPRET, False)


def lce_config_overrides() -> dict:
    """``VPL_LCE_CONFIG`` as a dict of ``LCEConfig`` fields (parsed once per distinct value)."""
    return _parse_json(os.environ.get(LCE_CONFIG, ""))


@functools.lru_cache(maxsize=16)
def _parse_json(text: str) -> dict:
    if not text.strip():
        return {}
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"{LCE_CONFIG} must be a JSON object of LCEConfig fields, got {text!r}")
    return value
