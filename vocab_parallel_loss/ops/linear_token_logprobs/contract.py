"""The contract of ``linear_token_logprobs``: its arguments beyond those of ``token_logprobs``
(``token_logprobs.contract``), which it shares."""

from __future__ import annotations

import math

from ... import checks


def check(hidden, weight, bias, softcap, logit_scale, impl, memory_budget,
          gradient_accumulation_fusion, tp_group, fp32_precision="fp32",
          batch_invariant=False) -> None:
    """Raises ``TypeError``/``ValueError`` naming the argument."""
    checks.check_group(tp_group)
    checks.check_fp32_precision(fp32_precision)
    checks.check_bool("batch_invariant", batch_invariant)
    checks.check_float("hidden", hidden)
    checks.check_float("weight", weight)
    checks.check_impl(impl)
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., H) and weight (V_local, H) disagree: {tuple(hidden.shape)}"
                         f" and {tuple(weight.shape)}")
    checks.check_linear_dtypes(hidden, weight, bias, "hidden", "weight")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be (V_local,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    checks.check_softcap(softcap)
    scale = checks.number("logit_scale", logit_scale)
    if not (math.isfinite(scale) and scale != 0):
        raise ValueError(f"logit_scale must be a finite non-zero float, got {logit_scale}")
    checks.check_memory_budget(memory_budget)
    checks.check_main_grad(weight, gradient_accumulation_fusion, "weight")


def sequence_rows(target, world: int):
    """Under sequence parallelism, the rows of the hidden states each rank sends to the gather:
    the targets' dim 0 (the same on every rank) over the group size, never a rank's own rows, so
    that every rank's collectives pair up; a rank holding other rows sends placeholder rows and
    every rank compares the rows with the statistics (``communication.check_shapes``). None
    for targets without dims (refused with the leading dims)."""
    shape = tuple(getattr(target, "shape", ()))
    if not shape:
        return None
    if shape[0] % world:
        raise ValueError(f"sequence_parallel=True: dim 0 of target {shape} is not divisible by "
                         f"the tensor-parallel group size {world}")
    return shape[0] // world
