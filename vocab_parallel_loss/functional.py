"""The public functions: the losses ``cross_entropy`` (over vocabulary-sharded logits) and
``linear_cross_entropy`` (from hidden states and classifier rows), and the per-token
log-probabilities and entropy ``token_logprobs`` / ``linear_token_logprobs``.

Each is its documentation over one call into its op (``ops/<op>``), which checks the arguments,
builds the options, picks the backend and strategy and runs the autograd Function."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import communication
from .ops import cross_entropy as _cross_entropy
from .ops import linear_cross_entropy as _linear_cross_entropy
from .ops import linear_token_logprobs as _linear_token_logprobs
from .ops import token_logprobs as _token_logprobs
from .ops.token_logprobs.contract import TokenLogprobs


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
    return_lse: bool = False,
):
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

    ``return_lse=True`` returns ``(loss, lse)``: the fp32 full-vocabulary log-sum-exp per token,
    shaped like ``target``, 0 for ignored tokens and not differentiable; it costs one more read
    of the logits.
    """
    try:
        loss = _cross_entropy.loss(logits, target, tp_group, label_smoothing, ignore_index,
                                   reduction, z_loss, inplace_backward, check_targets)
    except communication.ShapesDiffer:
        if return_lse:  # its gather runs on the other ranks: run it here too, then raise
            with contextlib.suppress(communication.ShapesDiffer):
                _cross_entropy.log_sum_exp(logits, target, tp_group, ignore_index)
        raise
    if not return_lse:
        return loss
    return loss, _cross_entropy.log_sum_exp(logits, target, tp_group, ignore_index)


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
    loss_mask: Optional[torch.Tensor] = None,
    fp32_precision: str = "fp32",
    batch_invariant: bool = False,
):
    """Cross entropy of ``e @ c.T (+ bias)`` over the full (TP-sharded) vocabulary, fused.

    Parameters
    ----------
    e : ``(..., H)`` hidden states (float). With ``sequence_parallel=True`` this rank's
        ``targets.shape[0] // world`` rows of dim 0, the sequence dim; it is all-gathered over
        ``tp_group`` (Megatron's output-layer layout ``[s, b, h]``). Ranks holding other numbers
        of rows raise ``ValueError`` (``communication.check_shapes``).
    c : ``(V_local, H)`` this rank's classifier rows; rank ``r`` holds global classes
        ``[r * V_local, (r + 1) * V_local)``. Same dtype and device as ``e``, or fp32 with
        16-bit ``e`` (an fp32 head: computed as for ``e`` cast to fp32, without that copy;
        the gradient of ``e`` comes back in ``e``'s dtype).
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
    return_lse : also return the per-token fp32 log-sum-exp (differentiable), that of ignored
        tokens too (``cross_entropy``'s is 0 there and not differentiable).
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
        chunks, down to one tile of columns beside the fp32 dE: a positive budget below that
        warns, 0 asks for it). The results agree to rounding; the PyTorch backend ignores it.
    gradient_accumulation_fusion : add the gradient of ``c`` into ``c.main_grad`` (fp32, or
        any float dtype: accumulated in fp32 and rounded once into it) instead of returning it,
        as megatron-core's output layer does under its flag of that name: ``c`` then receives
        zeros and ``c.grad_added_to_main_grad = True`` (so that megatron-core's DDP hook does
        not add them again), or no gradient where ``c`` lacks that attribute. Needs
        ``c.main_grad`` shaped like ``c``. Saves the ``(V_local, H)`` gradient in ``c``'s dtype
        and its rounding. Both backends.
    fp32_precision : the products where ``c`` is fp32. ``"fp32"`` (fp32-class error, also under
        autocast): the Triton kernels split the operands into parts the tensor cores multiply
        exactly (``kernels/linear/common.py``), the PyTorch backend runs fp32 GEMMs with TF32
        off; ``"tf32"``: TF32-class products, faster (the Triton kernels: one fp16 product of
        both operands rounded to TF32's 11 significand bits; PyTorch: TF32 GEMMs on CUDA, fp32
        on the CPU). No effect on 16-bit ``c``.
    loss_mask : with ``reduction="none"``, the weights the caller multiplies the per-token
        losses by (Megatron's loss mask; ``targets``' shape, any real dtype, not
        differentiated). The loss returned is unchanged. Where the saved logits do not fit the
        budget, the Triton backend then forms both gradients in forward for the upstream
        gradient ``loss_mask`` (6NHV, also under TP) and only scales them in backward when the
        upstream gradient is ``k * loss_mask`` exactly for one ``k`` (tested on the device);
        any other upstream gradient gets its exact gradient from a recompute launched every
        backward, whose kernels exit at once when it is not needed. The PyTorch backend
        recomputes (exact for any upstream gradient).
    batch_invariant : each token's forward outputs (its loss with ``reduction="none"``, its
        lse with ``return_lse=True``) are the same bits whatever batch it is computed in:
        independent of the other rows, their number, the token's position and
        ``memory_budget``, for a given backend, device, dtype, TP size and options (the
        ``"mean"`` and ``"sum"`` reductions are sums over the tokens: not per token). The
        gradients are not covered: ``dC`` sums over the tokens, and ``dE`` depends on the
        strategy (the budget and the rows choose it) and on GEMMs chosen by the number of
        rows. Costs a little forward speed at large batches and more at small ones (a fixed
        vocabulary split; docs/design.md, section 10).

    Returns
    -------
    The fp32 loss (fp64 for float64 inputs; scalar, or per token for ``reduction="none"``,
    shaped like the shifted targets), and with ``return_lse=True`` the tuple ``(loss, lse)``.
    Every rank returns the full-vocabulary values. A target outside ``[0, V)`` that is not
    ``ignore_index`` gives a NaN loss and lse for that token (no out-of-bounds read), and NaN
    gradients as through the logits: its row of ``e``'s, all of ``c``'s and ``bias``'s. The
    gradient of ``c`` is this rank's slice; the gradient of ``e`` is the full gradient (summed
    over the group in fp32, rounded once). Deterministic: no atomics; every sum is taken in a
    fixed order. No second derivative: a backward with ``create_graph=True`` through the loss
    raises.
    """
    return _linear_cross_entropy.loss(e, c, targets, bias, ignore_index, softcap, reduction,
                                      shift, return_lse, tp_group, sequence_parallel,
                                      label_smoothing, z_loss, impl, memory_budget,
                                      gradient_accumulation_fusion, loss_mask, fp32_precision,
                                      batch_invariant)


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
    batch_invariant: bool = False,
) -> TokenLogprobs:
    """Per-token log-probability of ``target`` (and optionally the entropy and the argmax) under
    ``softmax(logits / temperature)`` over the full vocabulary, from this rank's vocabulary shard.

    ``logits`` is ``(..., V_local)`` with any strides; ``target`` its leading shape (any integer
    dtype). ``temperature``: a float > 0 whose inverse is finite in the compute dtype (else
    ``ValueError``) or a float tensor of ``target``'s shape, or of one element (not
    differentiated). A tensor's values are not read on the host:
    a token whose temperature is not finite and > 0 (in the compute dtype) gets a NaN log-prob
    and entropy, and a NaN gradient wherever either is differentiated; its argmax, which no
    temperature > 0 moves, is still given. ``vocab_range=(start, stop)``: this rank's columns hold global ids
    ``[start, start + V_local)``, of which ``[start, stop)`` are vocabulary and the rest padding
    (ranks may hold different counts); by default rank ``r`` holds ``[r V_local, (r+1) V_local)``.
    The ranks' ranges must tile ``[0, V)`` in rank order; they travel with the statistics' one
    all-gather (a group may take other ranges, or another vocabulary, from call to call). Ranges
    that do not tile, or leave a rank's columns, raise ``ValueError`` on every rank that has not
    used its own range on this group before, and give NaN outputs on the others (as unequal
    widths do without ``vocab_range``, ``communication.check_shapes``).
    Returns ``TokenLogprobs(log_probs, entropy, argmax)`` shaped like ``target``: fp32 (float64
    for float64 logits), ``entropy``/``argmax`` None unless asked for. Ignored tokens get 0
    (argmax is still given); a target outside the vocabulary gets a NaN log-prob. Both float
    outputs are differentiable, each with its own upstream gradient.

    ``batch_invariant=True``: each token's log-prob, entropy and argmax are the same bits
    whatever batch it is computed in (independent of the other rows, their number and its
    position), for a given backend, device, dtype, TP size and options; so is the gradient of
    its logits row (computed from that row alone). The Triton kernels are so already (one
    program per row); the PyTorch backend then computes in blocks of one shape, and the TP
    merge sums the ranks in one order.
    """
    return _token_logprobs.logprobs(logits, target, tp_group, temperature, ignore_index,
                                    return_entropy, return_argmax, vocab_range,
                                    batch_invariant)


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
    fp32_precision: str = "fp32",
    batch_invariant: bool = False,
) -> TokenLogprobs:
    """``token_logprobs`` of the logits ``cap(logit_scale * (hidden @ weight.T + bias))``
    without materializing them: the Triton kernels form them tile by tile (the fused linear
    engine of ``linear_cross_entropy``), PyTorch one fp32 column chunk at a time.

    ``hidden`` is ``(..., H)``; with ``sequence_parallel=True`` this rank's shard of dim 0
    (Megatron's ``[s/tp, b, h]``): ``target.shape[0] // tp`` rows, gathered over ``tp_group``
    inside, its gradient reduce-scattered back. A ``target`` whose dim 0 the group size does not
    divide raises ``ValueError``; a rank holding other rows raises it too, with every rank that
    has not used its own shapes on this group before, and the others get NaN outputs (no rank
    is left waiting in the forward's collectives; a rank that raised runs no later one, so
    treat the error as fatal to the job). ``weight`` is this rank's ``(V_local, H)`` rows,
    ``target`` has the (gathered) leading shape of ``hidden``, the same on every rank.
    ``temperature`` as for ``token_logprobs``: a NaN log-prob and entropy where a per-token
    temperature is not finite and > 0, and a NaN gradient where either is differentiated (the
    gradient of ``weight`` sums over the tokens: NaN then). ``softcap`` applies
    ``softcap * tanh(y / softcap)``.
    The gradient of ``weight`` (and ``bias``) is this rank's slice, rounded once; the gradient of
    ``hidden`` is summed over the group in fp32 and rounded once. ``impl``: ``"triton"``,
    ``"torch"`` or ``"auto"``. ``memory_budget``: bytes of extra device memory the Triton path
    may hold from forward to backward, as for ``linear_cross_entropy`` (default 2 GiB; 0 for
    the least memory; with the saved-tiles strategy a second backward through the same outputs
    raises). ``gradient_accumulation_fusion``: the gradient of ``weight`` is added into
    ``weight.main_grad`` instead of returned, as for ``linear_cross_entropy``. ``weight`` may
    be fp32 with 16-bit ``hidden`` (an fp32 LM head), and ``fp32_precision`` chooses its
    products, as for ``linear_cross_entropy``.

    ``batch_invariant=True``: each token's log-prob, entropy and argmax are the same bits
    whatever batch it is computed in: independent of the other rows, their number, its
    position and ``memory_budget``, for a given backend, device, dtype, TP size and options
    (an RL trainer's recomputation of what an engine sampled with in another batch). The
    gradients are not covered: that of ``weight`` sums over the tokens, and that of ``hidden``
    depends on the strategy (the budget and the rows choose it) and on GEMMs chosen by the
    number of rows. Costs a little forward speed at large batches and more at small ones (a
    fixed vocabulary split; docs/design.md, section 10).
    """
    return _linear_token_logprobs.logprobs(
        hidden, weight, target, bias, tp_group, sequence_parallel, temperature, ignore_index,
        return_entropy, return_argmax, vocab_range, softcap, logit_scale, impl, memory_budget,
        gradient_accumulation_fusion, fp32_precision, batch_invariant)
