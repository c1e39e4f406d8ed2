"""Token log-probs and entropy from hidden states on the fused linear engine (Triton backend).

The same kernels as the fused linear loss (``kernels/linear``) in their log-prob mode: the
forward folds each ``tl.dot`` logits tile of ``x = cap(scale z) / T`` into the five log-prob
statistics (``formulas.merge_logprob_stats``), so no logits chunk is written; backward forms
``dz`` from the saved lse and entropy with two upstream gradients, through the loss's
coefficients plus one more:

    dx_j = g_lp [j == t] - p_j (g_lp + g_ent (x_j - lse + H))
         = gp p_j + gx p_j (x_j - lse) - gt [j == t]     gp = -(g_lp + g_ent H), gx = -g_ent,
                                                           gt = -g_lp

``memory_budget`` picks the strategy as for the loss (``strategy.py``; per-token outputs, so
never the gradient in forward): every logits tile saved in forward (6NHV), the first columns
saved and the rest recomputed, or all recomputed in column chunks (8NHV).

Vocabulary padding (``LogprobOptions.valid`` < the rows of ``c``) is left out of every kernel and gets
zero gradients. The TP merge, ignore and out-of-range handling are ``logprobs.finish``'s.
"""

from __future__ import annotations

from typing import Optional

import torch

from ... import backends, communication
from ...formulas import merge_logprob_stats
from ...runtime import untraced
from ...autograd.first_order import consume, refuse_double_backward, refuse_if_consumed
from ..token_logprobs import contract as logprob_contract
from ..token_logprobs import function as logprob_function
from ..token_logprobs.contract import LogprobOptions
from ..token_logprobs.function import finish, hidden_grad, upstream_grad
from . import contract
from ...autograd.main_grad import dummy as main_grad_dummy, home as main_grad_home
from ..fused_linear.strategy import choose_strategy


def _kernels():
    return backends.triton_linear


def _stats(e2, c, bias, t, o: LogprobOptions, lp, cfg, saved_cols: Optional[int]):
    """Local ``(5, N)`` statistics of the vocabulary columns, and the saved tiles (or None)."""
    K = _kernels()
    n, v = e2.shape[0], o.valid
    if n == 0 or v == 0:  # no rows, or a rank of padding only: the merge's neutral element
        stats = torch.zeros((5, n), dtype=torch.float32, device=e2.device)
        stats[0] = float("-inf")
        return stats, None
    b = None if bias is None else bias[:v]
    if saved_cols is None:
        return K.forward_stats(e2, c[:v], b, t, o.col_start, o.softcap, False, config=cfg,
                               logprob=lp), None
    vs = min(saved_cols, v)
    saved = K.saved_tiles(n, vs, e2.dtype, e2.device, cfg)
    stats = K.forward_stats(e2, c[:vs], None if b is None else b[:vs], t, o.col_start,
                            o.softcap, False, config=cfg, saved=saved, logprob=lp)
    if vs < v:
        rest = K.forward_stats(e2, c[vs:v], None if b is None else b[vs:], t, o.col_start + vs,
                               o.softcap, False, config=cfg, logprob=lp)
        stats = torch.stack(merge_logprob_stats(torch.stack([stats, rest])))
    return stats, saved


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, c, bias, t, inv_t, o: LogprobOptions, sequence_parallel: bool, plan):
        ctx.set_materialize_grads(False)
        K = _kernels()
        strategy, chunk_bytes, saved_cols, need_argmax, ctx.main_grad = plan
        full = communication.gather_along_first_dim(e, o.group) if sequence_parallel else e
        e2 = full.reshape(-1, full.shape[-1])
        cfg = K.default_config(e.device)
        lp = K.LogprobArgs(inv_t, o.scale, need_argmax)
        keep = None
        if strategy == "saved":
            keep = c.shape[0] if saved_cols is None else saved_cols
        stats, saved = _stats(e2, c, bias, t, o, lp, cfg, keep)
        logp, ent, lse, col, ignored, bad = finish(stats, t, o)
        kept = () if saved is None else (saved.u, saved.tile_max, stats[3])
        ctx.save_for_backward(e, c, bias, t, inv_t, lse, ent, ignored, bad, *kept)
        ctx.o, ctx.sp, ctx.chunk_bytes = o, sequence_parallel, chunk_bytes
        ctx.tile_v = None if saved is None else saved.block_v
        ctx.mark_non_differentiable(col)
        return logp, ent, col

    @staticmethod
    def backward(ctx, g_lp, g_ent, _):
        if torch.is_grad_enabled():  # create_graph=True
            refuse_double_backward("linear_token_logprobs")
        refuse_if_consumed(ctx, "linear_token_logprobs")
        e, c, bias, t, inv_t, lse, ent, ignored, bad, *kept = ctx.saved_tensors
        o: LogprobOptions = ctx.o
        need_e, need_c = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        if g_lp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        K = _kernels()
        cfg = K.default_config(e.device)
        if ctx.chunk_bytes:
            cfg = cfg.replace(chunk_bytes=ctx.chunk_bytes)
        full = communication.gather_along_first_dim(e, o.group) if ctx.sp else e
        e2 = full.reshape(-1, full.shape[-1])
        n, v = e2.shape[0], o.valid
        g_lp = upstream_grad(g_lp, n, lse, ignored, bad)
        g_ent = upstream_grad(g_ent, n, lse, ignored)
        zero = torch.zeros_like(lse)
        x_t = kept[2] if kept else zero
        coef = torch.stack([lse, -(g_lp + g_ent * ent), -g_lp, zero, x_t, -g_ent])
        lp = K.LogprobArgs(inv_t, o.scale)
        home = main_grad_home(c, ctx.main_grad, need_c)  # dC added there (padding: nothing)
        dc = (torch.empty_like(c, memory_format=torch.contiguous_format)
              if need_c and home is None else None)
        if dc is not None:  # the kernels write the vocabulary rows; padding (or all) gets 0
            dc[v if n else 0:].zero_()
        db = torch.zeros(c.shape[0], dtype=torch.float32, device=e.device) if need_b else None
        de = None
        b = None if bias is None else bias[:v]
        if n and v:
            start = 0
            if kept:
                consume(ctx, "their saved logits")
                u, tile_max = kept[0], kept[1]
                start = u.shape[1]
                saved = K.SavedTiles(u, tile_max, ctx.tile_v)
                # dE is final when no column is recomputed and there is no TP sum: round it once
                # straight into the input dtype
                final = start == v and communication.world_size(o.group) == 1
                de, _, db_s = K.backward_saved(
                    saved, e2, c[:start], need_b, t, o.col_start, coef, o.softcap, need_e,
                    need_c, e.dtype if final else torch.float32, cfg,
                    dc_out=None if dc is None else dc[:start], logprob=lp,
                    dc_acc=None if home is None else home[:start])
                if need_b:
                    db[:start] = db_s
            if start < v:
                de, _, db_r = K.backward(
                    e2, c[start:v], None if b is None else b[start:], t, o.col_start + start,
                    coef, o.softcap, need_e, need_c, need_b, config=cfg, de_acc=de,
                    dc_out=None if dc is None else dc[start:v], logprob=lp,
                    dc_acc=None if home is None else home[start:v])
                if need_b:
                    db[start:v] = db_r
        if home is not None:
            dc = main_grad_dummy(c)
        de_out = None
        if need_e:
            if de is None:  # no rows or no vocabulary columns here: this rank adds zeros
                de = torch.zeros(e2.shape, dtype=torch.float32, device=e.device)
            de_out = hidden_grad(de, full.shape, e, o.group, ctx.sp)
        return (de_out, dc, None if db is None else db.to(bias.dtype), None, None, None, None,
                None)


def from_hidden(e, c, bias, t, inv_t, o: LogprobOptions, sequence_parallel: bool, need_argmax: bool,
                memory_budget=None, main_grad: bool = False):
    """``(log_probs, entropy, argmax)`` flat, from hidden states and this rank's rows, on the
    Triton kernels (a graph break under torch.compile); with ``main_grad`` the gradient of ``c``
    is added into ``c.main_grad`` (``main_grad.py``)."""
    st = choose_strategy(_kernels(), e, c, bias, "none", sequence_parallel, o.group, o.softcap,
                         0.0, memory_budget, main_grad)
    plan = (st.name, st.chunk_bytes, st.size, need_argmax, main_grad)
    return untraced(_LinearLogprobs.apply, e, c, bias, t, inv_t, o, sequence_parallel, plan)


def logprobs(hidden, weight, target, bias, tp_group, sequence_parallel, temperature,
             ignore_index, return_entropy, return_argmax, vocab_range, softcap, logit_scale,
             impl, memory_budget, gradient_accumulation_fusion):
    """``functional.linear_token_logprobs`` (see there): check, options, backend and strategy,
    then the Function."""
    contract.check(hidden, weight, bias, softcap, logit_scale, impl, memory_budget,
                   gradient_accumulation_fusion)
    world = communication.world_size(tp_group)
    sp = bool(sequence_parallel) and world > 1
    lead = list(hidden.shape[:-1])
    if sp:
        lead[0] *= world
    t = logprob_contract.flat_targets(target, torch.Size(lead), hidden.device)
    kernels = impl != "torch" and hidden.dtype != torch.float64 and backends.triton_runs(hidden)
    if impl == "triton" and not kernels:
        raise ValueError("impl='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on CPU) of "
                         "fp32, bf16 or fp16; use impl='torch' or 'auto'")
    o = logprob_contract.options(tp_group, weight.shape[0], vocab_range, ignore_index,
                                 float(logit_scale), None if softcap is None else float(softcap),
                                 logprob_function.rows_backend(kernels, hidden.dtype),
                                 hidden.device)
    inv_t = logprob_contract.inverse_temperature(temperature, target, hidden)
    if kernels:
        lp, ent, col = from_hidden(hidden, weight, bias, t, inv_t, o, sp, bool(return_argmax),
                                   memory_budget, gradient_accumulation_fusion)
    else:
        lp, ent, col = logprob_function.from_hidden(hidden, weight, bias, t, inv_t, o, sp,
                                                    gradient_accumulation_fusion)
    return logprob_contract.shaped(lp, ent, col, target.shape, return_entropy, return_argmax)
