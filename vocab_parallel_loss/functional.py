"""The public functions: the losses ``cross_entropy`` (over vocabulary-sharded logits) and
``linear_cross_entropy`` (from hidden states and classifier rows), and the per-token
log-probabilities and entropy ``token_logprobs`` / ``linear_token_logprobs``."""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import backends, checks, communication, settings
from .autograd import compiled_ops
from .autograd import linear as linear_autograd
from .autograd import logits as logits_autograd
from .autograd import linear_logprobs as linear_logprobs_autograd
from .autograd import logprobs as logprobs_autograd
from .reference import logprobs as torch_logprobs
from .backends import IMPLS
from .runtime import compiling


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    reduction: str = "none",
    z_loss: float = 0.0,
    inplace_backward: bool = False,
    check_targets: Optional[bool] = None,
) -> torch.Tensor:
    """Full-vocabulary cross entropy from this rank's vocabulary shard ``logits[..., V_local]``.

    Rank ``r`` of ``tp_group`` holds columns ``[r * V_local, (r + 1) * V_local)``; every rank
    returns the same fp32 loss (fp64 for float64 logits). ``reduction`` is ``"none"`` (shape of
    ``target``), ``"mean"`` (over non-ignored tokens; 0 when there are none) or ``"sum"``.
    ``z_loss`` adds ``z_loss * lse**2`` per token. A target outside the vocabulary that is not
    ``ignore_index`` gives a NaN loss for that token (``check_targets=True`` or the environment
    variable ``VOCAB_PARALLEL_LOSS_CHECK_TARGETS=1``, read when a call signature is first seen or
    traced by ``torch.compile``, raises instead, at the cost of a host sync). Every rank must hold
    the same ``V_local``: see ``communication.check_shapes`` for how unequal shards are reported.

    ``inplace_backward=True``: the backward writes the gradient over ``logits`` and bumps their
    autograd version. Until then they keep their values; an autograd use of them whose backward
    runs later (one recorded before this loss, or a second backward) raises. Reads after the
    backward, outside autograd or by ops recorded after it, see the gradient: nothing can detect
    those. ``ValueError`` for logits that are a leaf requiring grad or a view of one, or whose
    elements share memory (expanded). The loss has no second derivative: a backward with
    ``create_graph=True`` through it raises.
    """
    return logits_autograd.loss(logits, target, tp_group, label_smoothing, ignore_index,
                                reduction, z_loss, inplace_backward, check_targets)


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    shift: int = 0,
    return_lse: bool = False,
    *,
    tp_group=None,
    sequence_parallel: bool = False,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    impl: str = "auto",
    memory_budget: Optional[float] = None,
    gradient_accumulation_fusion: bool = False,
):
    """Cross entropy of ``e @ c.T (+ bias)`` over the full (TP-sharded) vocabulary, fused.

    Parameters
    ----------
    e : ``(..., H)`` hidden states (float). With ``sequence_parallel=True`` this rank's
        ``targets.shape[0] // world`` rows of dim 0, the sequence dim; it is all-gathered over
        ``tp_group`` (Megatron's output-layer layout ``[s, b, h]``). Ranks holding other numbers
        of rows raise ``ValueError`` (``communication.check_shapes``).
    c : ``(V_local, H)`` this rank's classifier rows; rank ``r`` holds global classes
        ``[r * V_local, (r + 1) * V_local)``. Same dtype and device as ``e``.
    targets : integer tensor with ``e``'s (gathered) leading shape, global class ids; the same
        on every rank.
    bias : optional ``(V_local,)``.
    ignore_index : tokens with this target get loss 0 and gradient 0.
    softcap : logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
    reduction : ``"mean"`` (over non-ignored tokens; 0 when none), ``"sum"`` or ``"none"``.
    shift : drop the last ``shift`` positions of ``e`` and the first ``shift`` targets along
        the sequence dim (``shift=1``: causal LM with unshifted labels): dim -2 of ``e`` (dim -1
        of ``targets``, as in ``[b, s, h]``), or with ``sequence_parallel=True`` dim 0 (the
        gathered dim, as in Megatron's ``[s, b, h]``).
    return_lse : also return the per-token fp32 log-sum-exp (differentiable).
    tp_group : tensor-parallel process group (None: no parallelism).
    label_smoothing : PyTorch's convention, over the global vocabulary.
    z_loss : adds ``z_loss * lse**2`` per (non-ignored) token.
    impl : ``"triton"``, ``"torch"`` (chunked PyTorch) or ``"auto"`` (Triton on CUDA or under
        ``TRITON_INTERPRET=1``, else PyTorch).
    memory_budget : bytes of device memory the Triton backend may hold beyond the inputs and
        the gradients it returns; it takes the fastest strategy that fits (None: 2 GiB):
        saving the logits for backward (``N x V_local`` elements of the input dtype; 6NHV),
        for a scalar loss forming the gradients in forward (an fp32 ``(V_local, H)``
        accumulator; 6NHV; without TP), else recomputing the logits in backward in column
        chunks (8NHV, about 0.4 GiB at 16K tokens of H=4096; a smaller budget narrows the
        chunks). The results agree to rounding; the PyTorch backend ignores it.
    gradient_accumulation_fusion : add the gradient of ``c`` into ``c.main_grad`` (fp32, or
        any float dtype: accumulated in fp32 and rounded once into it) instead of returning it,
        as megatron-core's output layer does under its flag of that name: ``c`` then receives
        zeros and ``c.grad_added_to_main_grad = True`` (so that megatron-core's DDP hook does
        not add them again), or no gradient where ``c`` lacks that attribute. Needs
        ``c.main_grad`` shaped like ``c``. Saves the ``(V_local, H)`` gradient in ``c``'s dtype
        and its rounding. Both backends.

    Returns
    -------
    The fp32 loss (fp64 for float64 inputs; scalar, or per token for ``reduction="none"``,
    shaped like the shifted targets), and with ``return_lse=True`` the tuple ``(loss, lse)``.
    Every rank returns the full-vocabulary values. A target outside ``[0, V)`` that is not
    ``ignore_index`` gives a NaN loss for that token (no out-of-bounds read). The gradient of
    ``c`` is this rank's slice; the gradient of ``e`` is the full gradient (summed over the group
    in fp32, rounded once). Deterministic: no atomics; every sum is taken in a fixed order. No
    second derivative: a backward with ``create_graph=True`` through the loss raises.
    """
    _validate(e, c, targets, bias, ignore_index, softcap, reduction, shift, tp_group,
              sequence_parallel, label_smoothing, z_loss, impl)
    checks.check_memory_budget(memory_budget)
    checks.check_main_grad(c, gradient_accumulation_fusion)
    targets = checks.widened_target(targets, int(ignore_index), "targets")
    if settings.flag(settings.CHECK_TARGETS, False):
        vocab = c.shape[0] * communication.world_size(tp_group)
        if compiling():  # the check reads the device: an op of the graph, run at run time
            targets = compiled_ops.checked_targets(targets, vocab, int(ignore_index))
        else:
            checks.check_target_range(targets, vocab, ignore_index)
    loss, lse = linear_autograd.linear_loss(
        e, c, bias, targets, backends.linear_backend(impl, e), ignore_index=int(ignore_index),
        softcap=float(softcap) if softcap else None, reduction=reduction, shift=int(shift),
        group=tp_group, sequence_parallel=bool(sequence_parallel),
        smoothing=float(label_smoothing), z_loss=float(z_loss), memory_budget=memory_budget,
        main_grad=gradient_accumulation_fusion)
    return (loss, lse) if return_lse else loss


def _validate(e, c, targets, bias, ignore_index, softcap, reduction, shift, group,
              sequence_parallel, label_smoothing, z_loss, impl):
    checks.check_float("e", e)
    checks.check_float("c", c)
    checks.check_target_dtype(targets, "targets")
    checks.check_ignore_index(ignore_index)
    checks.check_smoothing(label_smoothing)
    checks.check_reduction(reduction)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if e.dim() < 2:
        raise ValueError(f"e must be (..., H) with at least one leading dim, got shape {tuple(e.shape)}")
    if c.dim() != 2:
        raise ValueError(f"c must be (V_local, H), got shape {tuple(c.shape)}")
    if c.shape[0] < 1:
        raise ValueError("c must hold at least one vocabulary row")
    if e.shape[-1] != c.shape[1]:
        raise ValueError(f"e and c disagree on the hidden size H: e {tuple(e.shape)}, "
                         f"c {tuple(c.shape)}")
    if e.dtype != c.dtype:
        raise ValueError(f"e and c must have the same dtype, got {e.dtype} and {c.dtype}")
    if bias is not None:
        checks.check_float("bias", bias)
        if tuple(bias.shape) != (c.shape[0],):
            raise ValueError(f"bias must be (V_local,) = ({c.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != c.dtype:
            raise ValueError(f"bias dtype {bias.dtype} differs from c's {c.dtype}")
    checks.check_same_device(e=e, c=c, targets=targets, bias=bias)
    checks.check_z_loss(z_loss)
    checks.check_softcap(softcap)
    checks.check_shift(shift)
    lead = list(e.shape[:-1])
    world = communication.world_size(group)
    if sequence_parallel and world > 1:
        # only what the targets decide (the same on every rank) is checked here: each rank's
        # rows of e are compared with targets.shape[0] // world across the group, so that every
        # rank raises, not only some while the others wait in the gather (check_shapes)
        if targets.shape[0:1] and targets.shape[0] % world:
            raise ValueError(f"sequence_parallel=True: dim 0 of targets {tuple(targets.shape)} "
                             f"is not divisible by the tensor-parallel group size {world}")
        lead[0] = targets.shape[0] if targets.shape[0:1] else lead[0] * world
    checks.check_leading_shape(
        "leading dims of e" + (" (gathered over the TP group)" if sequence_parallel else ""),
        torch.Size(lead), targets)


def token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    tp_group=None,
    temperature=1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_argmax: bool = False,
    vocab_range: Optional[tuple] = None,
) -> "logprobs_autograd.TokenLogprobs":
    """Per-token log-probability of ``target`` (and optionally the entropy and the argmax) under
    ``softmax(logits / temperature)`` over the full vocabulary, from this rank's vocabulary shard.

    ``logits`` is ``(..., V_local)`` with any strides; ``target`` its leading shape (any integer
    dtype). ``temperature``: a float > 0 or a float tensor of ``target``'s shape (not
    differentiated). ``vocab_range=(start, stop)``: this rank's columns hold global ids
    ``[start, start + V_local)``, of which ``[start, stop)`` are vocabulary and the rest padding
    (ranks may hold different counts); by default rank ``r`` holds ``[r V_local, (r+1) V_local)``.
    Returns ``TokenLogprobs(log_probs, entropy, argmax)`` shaped like ``target``: fp32 (float64
    for float64 logits), ``entropy``/``argmax`` None unless asked for. Ignored tokens get 0
    (argmax is still given); a target outside the vocabulary gets a NaN log-prob. Both float
    outputs are differentiable, each with its own upstream gradient.
    """
    checks.check_float("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty vocabulary dim, got {tuple(logits.shape)}")
    t = _flat_targets(target, logits.shape[:-1], logits.device)
    o = _logprob_options(tp_group, logits.shape[-1], vocab_range, ignore_index, 1.0, None,
                         _rows_backend(backends.triton_runs(logits), logits.dtype),
                         logits.device)
    inv_t = _inverse_temperature(temperature, target, logits)
    lp, ent, col = logprobs_autograd.from_logits(logits, t, inv_t, o)
    return _shaped(lp, ent, col, target.shape, return_entropy, return_argmax)


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    *,
    tp_group=None,
    sequence_parallel: bool = False,
    temperature=1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    return_argmax: bool = False,
    vocab_range: Optional[tuple] = None,
    softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    impl: str = "auto",
    memory_budget: Optional[int] = None,
    gradient_accumulation_fusion: bool = False,
) -> "logprobs_autograd.TokenLogprobs":
    """``token_logprobs`` of the logits ``cap(logit_scale * (hidden @ weight.T + bias))``
    without materializing them: the Triton kernels form them tile by tile (the fused linear
    engine of ``linear_cross_entropy``), PyTorch one fp32 column chunk at a time.

    ``hidden`` is ``(..., H)``; with ``sequence_parallel=True`` this rank's shard of dim 0
    (Megatron's ``[s/tp, b, h]``), gathered over ``tp_group`` inside, its gradient
    reduce-scattered back. ``weight`` is this rank's ``(V_local, H)`` rows, ``target`` has the
    (gathered) leading shape of ``hidden``. ``softcap`` applies ``softcap * tanh(y / softcap)``.
    The gradient of ``weight`` (and ``bias``) is this rank's slice, rounded once; the gradient of
    ``hidden`` is summed over the group in fp32 and rounded once. ``impl``: ``"triton"``,
    ``"torch"`` or ``"auto"``. ``memory_budget``: bytes of extra device memory the Triton path
    may hold from forward to backward, as for ``linear_cross_entropy`` (default 2 GiB; 0 for
    the least memory; with the saved-tiles strategy a second backward through the same outputs
    raises). ``gradient_accumulation_fusion``: the gradient of ``weight`` is added into
    ``weight.main_grad`` instead of returned, as for ``linear_cross_entropy``.
    """
    checks.check_float("hidden", hidden)
    checks.check_float("weight", weight)
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden (..., H) and weight (V_local, H) disagree: {tuple(hidden.shape)}"
                         f" and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError("hidden, weight and bias must have one dtype")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be (V_local,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    if softcap is not None and not (math.isfinite(float(softcap)) and float(softcap) > 0):
        raise ValueError(f"softcap must be None or a finite float > 0, got {softcap}")
    if not (math.isfinite(float(logit_scale)) and float(logit_scale) != 0):
        raise ValueError(f"logit_scale must be a finite non-zero float, got {logit_scale}")
    sp = bool(sequence_parallel) and communication.world_size(tp_group) > 1
    lead = list(hidden.shape[:-1])
    if sp:
        lead[0] *= communication.world_size(tp_group)
    t = _flat_targets(target, torch.Size(lead), hidden.device)
    kernels = impl != "torch" and hidden.dtype != torch.float64 and backends.triton_runs(hidden)
    if impl == "triton" and not kernels:
        raise ValueError("impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU) of "
                         "fp32, bf16 or fp16; use impl='torch' or 'auto'")
    o = _logprob_options(tp_group, weight.shape[0], vocab_range, ignore_index,
                         float(logit_scale), None if softcap is None else float(softcap),
                         _rows_backend(kernels, hidden.dtype), hidden.device)
    checks.check_memory_budget(memory_budget)
    checks.check_main_grad(weight, gradient_accumulation_fusion, "weight")
    inv_t = _inverse_temperature(temperature, target, hidden)
    if kernels:
        lp, ent, col = linear_logprobs_autograd.from_hidden(
            hidden, weight, bias, t, inv_t, o, sp, bool(return_argmax), memory_budget,
            gradient_accumulation_fusion)
    else:
        lp, ent, col = logprobs_autograd.from_hidden(hidden, weight, bias, t, inv_t, o, sp,
                                                     gradient_accumulation_fusion)
    return _shaped(lp, ent, col, target.shape, return_entropy, return_argmax)


def _flat_targets(target, lead, device):
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or target.is_complex():
        raise TypeError(f"target must be an integer tensor, got "
                        f"{getattr(target, 'dtype', type(target))}")
    if tuple(target.shape) != tuple(lead):
        raise ValueError(f"target shape {tuple(target.shape)} does not match the leading dims "
                         f"{tuple(lead)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device}, the inputs on {device}")
    return target.reshape(-1).to(torch.int64)  # any integer dtype compares exactly as int64


def _rows_backend(kernels: bool, dtype):
    if kernels and dtype != torch.float64 and backends.triton_logprobs is not None:
        return backends.triton_logprobs
    return torch_logprobs


def _logprob_options(group, v_local, vocab_range, ignore_index, scale, softcap, rows, device):
    if isinstance(ignore_index, bool) or int(ignore_index) != ignore_index:
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    world = communication.world_size(group)
    if vocab_range is None:  # equal shards, checked with the statistics' all-gather
        start, valid, vocab = communication.rank(group) * v_local, v_local, world * v_local
    else:
        start, stop = (int(x) for x in vocab_range)
        if not 0 <= start <= stop <= start + v_local:
            raise ValueError(f"vocab_range must be (start, stop) with 0 <= start <= stop <= start"
                             f" + V_local ({v_local}), got {tuple(vocab_range)}")
        start, valid = start, stop - start
        vocab = communication.vocab_size_of_ranges(start, stop, group, device)
    return logprobs_autograd.Options(group, start, valid, int(ignore_index), vocab, scale,
                                     softcap, rows, 0 if vocab_range is not None else v_local)


def _inverse_temperature(temperature, target, like):
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    if isinstance(temperature, torch.Tensor):
        if temperature.requires_grad and torch.is_grad_enabled():
            raise ValueError("temperature is not differentiated: pass it detached")
        if not temperature.is_floating_point():
            raise TypeError(f"temperature must be a float tensor, got {temperature.dtype}")
        if temperature.numel() == 1 and temperature.dim() == 0:
            return (1.0 / temperature.to(device=like.device, dtype=dtype)).reshape(1)
        if tuple(temperature.shape) != tuple(target.shape):
            raise ValueError(f"a temperature tensor must have the target's shape "
                             f"{tuple(target.shape)}, got {tuple(temperature.shape)}")
        return (1.0 / temperature.to(device=like.device, dtype=dtype)).reshape(-1).contiguous()
    value = float(temperature)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
    return torch.full((1,), 1.0 / value, dtype=dtype, device=like.device)


def _shaped(lp, ent, col, shape, return_entropy, return_argmax):
    return logprobs_autograd.TokenLogprobs(
        lp.view(shape), ent.view(shape) if return_entropy else None,
        col.view(shape) if return_argmax else None)
