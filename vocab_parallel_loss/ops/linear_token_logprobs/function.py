"""Token log-probs and entropy from hidden states on the fused linear engine, either backend
(``backends.linear_backend``: the Triton kernels of ``kernels/linear`` or the PyTorch
``reference.linear.TorchBackend``).

The engine runs in its log-prob mode (``formulas.LogprobArgs``): the forward folds the logits
``x = cap(scale z) / T`` into the five log-prob statistics (``formulas.merge_logprob_stats``)
without storing the logits; backward forms ``dz`` from the saved lse and entropy with two
upstream gradients, through the loss's coefficients plus one more:

    dx_j = g_lp [j == t] - p_j (g_lp + g_ent (x_j - lse + H))
         = gp p_j + gx p_j (x_j - lse) - gt [j == t]     gp = -(g_lp + g_ent H), gx = -g_ent,
                                                           gt = -g_lp

``memory_budget`` picks the strategy among the backend's (``strategy.py``; per-token outputs,
so never the gradient in forward): every logits tile saved in forward (6NHV), the first columns
saved and the rest recomputed, or all recomputed in column chunks (8NHV). The column passes are
the loss's (``fused_linear/columns.py``).

Vocabulary padding (``LogprobOptions.valid`` < the rows of ``c``) is left out of every pass and
gets zero gradients. The TP merge, ignore and out-of-range handling are ``token_logprobs``'
``finish``.
"""

from __future__ import annotations

import torch

from ... import backends, communication
from ...formulas import LogprobArgs, compute_dtype
from ...runtime import untraced
from ...autograd.first_order import consume, refuse_double_backward, refuse_if_consumed
from ...autograd.main_grad import dummy as main_grad_dummy, home as main_grad_home
from ..token_logprobs import contract as logprob_contract
from ..token_logprobs.contract import LogprobOptions
from ..token_logprobs.function import finish, hidden_grad, upstream_grad
from . import contract
from ..fused_linear.columns import backward_columns, forward_columns
from ..fused_linear.strategy import Strategy, choose_strategy


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, bias, t, inv_t, bad_t, o: LogprobOptions, sequence_parallel: bool,
                plan):
        ctx.set_materialize_grads(False)
        K, st, need_argmax, main_grad, precision = plan
        full = (communication.gather_along_first_dim(e, o.group, o.sequence_rows)
                if sequence_parallel else e)
        e2 = full.reshape(-1, full.shape[-1])
        n, v = e2.shape[0], o.valid
        if n == 0 or v == 0:  # no rows, or a rank of padding only: the merge's neutral element
            stats = torch.zeros((5, n), dtype=compute_dtype(e.dtype), device=e.device)
            stats[0] = float("-inf")
            saved = None
        else:
            keep = None
            if st.name == "saved":
                keep = v if st.size is None else st.size
            stats, saved = forward_columns(K, e2, c[:v], None if bias is None else bias[:v], t,
                                           o.col_start, o.softcap, False, keep,
                                           LogprobArgs(inv_t, o.scale, need_argmax), precision,
                                           invariant=o.invariant, room=st.room)
        logp, ent, lse, col, ignored, bad, bad_ent, _ = finish(stats, t, o, bad_t)
        kept = () if saved is None else (saved.u, saved.tile_max, stats[3])
        ctx.save_for_backward(e, c, bias, t, inv_t, lse, ent, ignored, bad, bad_ent, *kept)
        ctx.o, ctx.sp, ctx.plan = o, sequence_parallel, plan
        ctx.tile_v = None if saved is None else saved.block_v
        ctx.mark_non_differentiable(col)
        return logp, ent, col

    @staticmethod
    def backward(ctx, g_lp, g_ent, _):
        if torch.is_grad_enabled():  # create_graph=True
            refuse_double_backward("linear_token_logprobs")
        refuse_if_consumed(ctx, "linear_token_logprobs")
        e, c, bias, t, inv_t, lse, ent, ignored, bad, bad_ent, *kept = ctx.saved_tensors
        o: LogprobOptions = ctx.o
        K, st, _, main_grad, precision = ctx.plan
        need_e, need_c = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None, None
        full = communication.gather_along_first_dim(e, o.group, o.sequence_rows) if ctx.sp else e
        e2 = full.reshape(-1, full.shape[-1])
        n, v = e2.shape[0], o.valid
        g_lp = upstream_grad(g_lp, n, lse, ignored, bad)
        g_ent = upstream_grad(g_ent, n, lse, ignored, bad_ent)
        zero = torch.zeros_like(lse)
        if bad_ent is not None:
            # the NaN entropy of an unusable temperature must not reach the coefficient through
            # g_ent = 0 (its output not differentiated): a differentiated one has g_ent NaN
            ent = torch.where(bad_ent, zero, ent)
        x_t = kept[2].to(lse.dtype) if kept else zero
        coef = torch.stack([lse, -(g_lp + g_ent * ent), -g_lp, zero, x_t, -g_ent])
        home = main_grad_home(c, main_grad, need_c)  # dC added there (padding: nothing)
        dc = (torch.empty_like(c, memory_format=torch.contiguous_format)
              if need_c and home is None else None)
        if dc is not None:  # the passes write the vocabulary rows; padding (or all) gets 0
            dc[v if n else 0:].zero_()
        acc = compute_dtype(e.dtype)
        db = torch.zeros(c.shape[0], dtype=acc, device=e.device) if need_b else None
        de = None
        if n and v:
            saved = None
            if kept:
                consume(ctx, "their saved logits")
                saved = K.SavedTiles(kept[0], kept[1], ctx.tile_v)
            de, _, db_v = backward_columns(
                K, e2, c[:v], None if bias is None else bias[:v], t, o.col_start, coef,
                o.softcap, need_e, need_c, need_b, saved=saved,
                de_final=communication.world_size(o.group) == 1, chunk_bytes=st.chunk_bytes,
                dc_out=None if dc is None else dc[:v],
                dc_acc=None if home is None else home[:v], logprob=LogprobArgs(inv_t, o.scale),
                precision=precision)
            if need_b:
                db[:v] = db_v
        if home is not None:
            dc = main_grad_dummy(c)
        de_out = None
        if need_e:
            if de is None:  # no rows or no vocabulary columns here: this rank adds zeros
                de = torch.zeros(e2.shape, dtype=acc, device=e.device)
            de_out = hidden_grad(de, full.shape, e, o.group, ctx.sp)
        return (de_out, dc, None if db is None else db.to(bias.dtype), None, None, None, None,
                None, None)


def from_hidden(backend, e, c, bias, t, inv_t, bad_t, o: LogprobOptions, sequence_parallel: bool,
                need_argmax: bool, memory_budget=None, main_grad: bool = False,
                fp32_precision: str = "fp32"):
    """``(log_probs, entropy, argmax)`` flat, from hidden states and this rank's rows on
    ``backend`` (a graph break under torch.compile unless it is ``TRACEABLE``); with
    ``main_grad`` the gradient of ``c`` is added into ``c.main_grad`` (``main_grad.py``);
    ``fp32_precision``: the products of fp32 operands (``checks.FP32_PRECISIONS``)."""
    st: Strategy = choose_strategy(backend, e, c, bias, "none", sequence_parallel, o.group,
                                   o.softcap, 0.0, memory_budget, main_grad,
                                   invariant=o.invariant)
    plan = (backend, st, need_argmax, main_grad, fp32_precision)
    args = (e, c, bias, t, inv_t, bad_t, o, sequence_parallel, plan)
    if backend.TRACEABLE:  # plain PyTorch: Dynamo traces it into the graph
        return _LinearLogprobs.apply(*args)
    return untraced(_LinearLogprobs.apply, *args)


def logprobs(hidden, weight, target, bias, tp_group, sequence_parallel, temperature,
             ignore_index, return_entropy, return_argmax, vocab_range, softcap, logit_scale,
             impl, memory_budget, gradient_accumulation_fusion, fp32_precision="fp32",
             batch_invariant=False):
    """``functional.linear_token_logprobs`` (see there): check, options, backend and strategy,
    then the Function."""
    contract.check(hidden, weight, bias, softcap, logit_scale, impl, memory_budget,
                   gradient_accumulation_fusion, tp_group, fp32_precision, batch_invariant)
    world = communication.world_size(tp_group)
    sp = bool(sequence_parallel) and world > 1
    lead = list(hidden.shape[:-1])
    seq_rows = (0, 0)
    rows = contract.sequence_rows(target, world) if sp else None
    if rows is not None:
        lead[0] = rows * world
        seq_rows = (hidden.shape[0], rows)
    t = logprob_contract.flat_targets(target, torch.Size(lead), hidden.device)
    backend = backends.linear_backend(impl, hidden)
    o = logprob_contract.options(tp_group, weight.shape[0], vocab_range, ignore_index,
                                 float(logit_scale), None if softcap is None else float(softcap),
                                 None, seq_rows,  # no row backend: the engine's stats
                                 batch_invariant=batch_invariant)
    inv_t, bad_t = logprob_contract.inverse_temperature(temperature, target, hidden)
    lp, ent, col = from_hidden(backend, hidden, weight, bias, t, inv_t, bad_t, o, sp,
                               bool(return_argmax), memory_budget, gradient_accumulation_fusion,
                               fp32_precision)
    return logprob_contract.shaped(lp, ent, col, target.shape, return_entropy, return_argmax)
