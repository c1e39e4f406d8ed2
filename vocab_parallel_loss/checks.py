"""Argument checks shared by every loss: clear errors instead of silently wrong results."""

from __future__ import annotations

import torch

REDUCTIONS = ("none", "mean", "sum")

def check_float(name: str, t: torch.Tensor) -> None:
    if not torch.is_floating_point(t):
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_target_dtype(target: torch.Tensor) -> None:
    if target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"target must be an integer tensor (int32 or int64), got {target.dtype}")


def check_smoothing(label_smoothing: float) -> None:
    if not 0.0 <= float(label_smoothing) <= 1.0:
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
    if float(z_loss) < 0:
        raise ValueError(f"z_loss must be >= 0, got {z_loss}")
