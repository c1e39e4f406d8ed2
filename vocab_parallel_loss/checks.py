"""Argument checks shared by every loss: clear errors instead of silently wrong results."""

from __future__ import annotations

import math
import numbers

import torch

REDUCTIONS = ("none", "mean", "sum")
#: ``impl`` values of the fused linear ops
IMPLS = ("auto", "triton", "torch")

#: ``fp32_precision`` of the fused linear ops: the products where the weight (or hidden states)
#: are fp32. ``"fp32"``: split products on the tensor cores, fp32-class error; ``"tf32"``: one
#: TF32 product each, faster, with TF32-class error (10-bit mantissas).
FP32_PRECISIONS = ("fp32", "tf32")

#: target dtypes used as they are; the kernels read them and widen in registers
WIDE_TARGETS = (torch.int64, torch.int32)
#: narrower integer targets, widened to int64 once at the entry: compared in their own dtype,
#: ``ignore_index`` (-100) and vocabulary sizes past their range would wrap
NARROW_TARGETS = tuple(getattr(torch, name) for name in ("int16", "int8", "uint8", "uint16",
                                                         "uint32") if hasattr(torch, name))
_TARGET_NAMES = ", ".join(str(d).replace("torch.", "") for d in WIDE_TARGETS + NARROW_TARGETS)
_I32 = 2**31
_I64 = 2**63


def check_float(name: str, t: torch.Tensor) -> None:
    if not torch.is_floating_point(t):
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_target_dtype(target: torch.Tensor, name: str = "target") -> None:
    if target.dtype not in WIDE_TARGETS and target.dtype not in NARROW_TARGETS:
        raise TypeError(f"{name} must be an integer tensor of class ids ({_TARGET_NAMES}), "
                        f"got {target.dtype}")


def widened_target(target: torch.Tensor, ignore_index: int, name: str = "target") -> torch.Tensor:
    """``target`` itself when int64, or int32 with ``ignore_index`` in int32's range; else its
    int64 copy (a cheap cast of N integers), so every comparison happens in 64 bits."""
    dtype = target.dtype
    if dtype is torch.int64 or (dtype is torch.int32 and -_I32 <= ignore_index < _I32):
        return target
    check_target_dtype(target, name)
    return target.long()


def check_ignore_index(ignore_index) -> int:
    """``ignore_index`` as an int: any integer type but bool, within int64's range."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    value = int(ignore_index)
    if not -_I64 <= value < _I64:
        raise ValueError(f"ignore_index must fit in int64, got {value}")
    return value


def number(name: str, value) -> float:
    """``value`` as a float, or ``TypeError`` naming ``name`` (a string, None, anything
    ``float()`` refuses)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None


def check_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= number("label_smoothing", label_smoothing) <= 1.0:  # NaN fails too
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def check_leading_shape(what: str, leading: torch.Size, target: torch.Tensor) -> None:
    if tuple(target.shape) != tuple(leading):
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match the {what} "
            f"{tuple(leading)}"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors are on different devices: {devices}")


def check_target_range(target: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Opt-in: raise on a target outside [0, vocab_size) that is not ``ignore_index`` (syncs)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        value = int(target[bad].flatten()[0])
        raise ValueError(
            f"target value {value} is outside the vocabulary [0, {vocab_size}) "
            f"and is not the ignore index {ignore_index}"
        )


def check_z_loss(z_loss: float) -> None:
    if not 0.0 <= number("z_loss", z_loss) < math.inf:  # NaN fails too
        raise ValueError(f"z_loss must be finite and >= 0, got {z_loss}")


def check_memory_budget(memory_budget) -> None:
    if isinstance(memory_budget, bool):
        raise TypeError(f"memory_budget must be None or a number of bytes, got {memory_budget!r}")
    if memory_budget is not None and not 0.0 <= number("memory_budget", memory_budget) < math.inf:
        raise ValueError(f"memory_budget must be None or a finite number of bytes >= 0, "
                         f"got {memory_budget}")


def check_main_grad(c: torch.Tensor, gradient_accumulation_fusion, name: str = "c") -> None:
    """``gradient_accumulation_fusion=True`` adds the gradient of ``c`` (the argument ``name``)
    into ``c.main_grad``: that must be a float tensor shaped like ``c`` on its device."""
    if not isinstance(gradient_accumulation_fusion, bool):
        raise TypeError(f"gradient_accumulation_fusion must be a bool, got "
                        f"{gradient_accumulation_fusion!r}")
    if not gradient_accumulation_fusion:
        return
    home = getattr(c, "main_grad", None)
    if not isinstance(home, torch.Tensor):
        raise ValueError(f"gradient_accumulation_fusion=True needs {name}.main_grad, the tensor "
                         f"the gradient of {name} is added into (megatron-core's DDP sets it); "
                         f"{name} has none")
    if home.shape != c.shape or not home.is_floating_point() or home.device != c.device:
        raise ValueError(f"gradient_accumulation_fusion=True: {name}.main_grad must be a float "
                         f"tensor shaped like {name} {tuple(c.shape)} on {c.device}, got "
                         f"{home.dtype} {tuple(home.shape)} on {home.device}")


def check_softcap(softcap) -> None:
    if softcap is not None and not 0.0 < number("softcap", softcap) < math.inf:
        raise ValueError(f"softcap must be None or finite and > 0, got {softcap}")


def check_shift(shift) -> None:
    if isinstance(shift, bool) or not isinstance(shift, numbers.Real) or int(shift) != shift \
            or shift < 0:
        raise ValueError(f"shift must be a non-negative int, got {shift!r}")


def check_group(group, name: str = "tp_group") -> None:
    """``group`` is None (no tensor parallelism) or a ``torch.distributed.ProcessGroup``. Anything
    else would pass for a single rank while no process group exists, and fail inside a
    collective once one does."""
    if group is None:
        return
    dist = torch.distributed
    pg = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if pg is None or not isinstance(group, pg):
        shown = repr(group)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(f"{name} must be None or a torch.distributed.ProcessGroup, got "
                        f"{type(group).__name__} {shown}")


def check_fp32_precision(fp32_precision) -> None:
    if not isinstance(fp32_precision, str) or fp32_precision not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS}, got "
                         f"{fp32_precision!r}")


def check_linear_dtypes(e: torch.Tensor, c: torch.Tensor, bias, e_name: str = "e",
                        c_name: str = "c") -> None:
    """One dtype for the hidden states ``e`` and the classifier rows ``c``, or 16-bit hidden
    states with fp32 rows (an fp32 LM head: the products are those of ``e`` cast to fp32,
    without the copy). ``bias`` takes the dtype of ``c``."""
    head = c.dtype == torch.float32 and e.dtype in (torch.bfloat16, torch.float16)
    if e.dtype != c.dtype and not head:
        raise ValueError(f"{e_name} and {c_name} must have the same dtype, or {e_name} 16-bit "
                         f"with {c_name} fp32 (an fp32 head); got {e.dtype} and {c.dtype}")
    if bias is not None and bias.dtype != c.dtype:
        raise ValueError(f"bias dtype {bias.dtype} differs from {c_name}'s {c.dtype}")
def check_bool(name: str, value) -> None:
    """A flag that must be a real ``bool`` (a tensor or a number would be taken for its truth
    value, or fail later inside a kernel launch)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
