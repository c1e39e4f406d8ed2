#!/usr/bin/env python
"""Peak memory of one Megatron-LM training step per loss path, as a function of the tokens per
micro-batch: the model docs/performance.md ("Long context: memory per loss path") writes out,
and the predictions the long-context sweep (tools/megatron_lm_long_context.py) prints and stores
beside its measurements.

    PYTHONPATH=. python tools/megatron_lm_memory_model.py [--vocab 151936 262144] [--limit-gib 139]

Bytes, bf16, TP = 1, N = sequence x micro-batch tokens, V the vocabulary, H the hidden size:

* the same for every path: parameters, fp32 gradient buffer, fp32 master weights and Adam's two
  moments (2 + 4 + 4 + 8 = 18 bytes a parameter), and the activations the layers keep for
  backward (``activation_bytes``), which grow with N;
* the loss path's own N x V terms at its peak (``loss_bytes``): megatron-core native 6NV (the
  bf16 logits 2NV beside their fp32 copy 4NV in forward; that copy, the softmax then the fp32
  gradient, beside the bf16 gradient 2NV in backward), megatron-core fused 10NV (measured 4NV
  above native), ours over logits 4NV (the bf16 logits kept for backward and the bf16 gradient;
  2NV with ``--vocab-parallel-loss-inplace-backward``), ours fused linear no N x V term beyond
  what its strategy holds under the budget (``vocab_parallel_loss.ops.fused_linear.strategy``,
  the real choice, run here on shapes only) and the bf16 gradients it returns, 2(V + N)H.

The activation count is the standard one (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022): 34 N H bytes a layer without the attention
scores, plus 5 a s^2 b a layer for megatron-core's local attention that materializes them (a heads,
s sequence, b micro-batch), or 5 a s^2 b once with selective recompute (one layer's, while its
attention runs, forward or recomputed), and its s^2 causal mask; the SDPA attention keeps
4 N H more (rope's rotated query and key beside the QKV projection's output the value still
views; the attention's output copied to the sequence-first layout) and fp32 row statistics
(4 a N). Embedding, final norm and the output layer's input add about 10 N H once.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Optional, Sequence

GIB = 2**30
#: What ``torch.cuda.max_memory_allocated`` may reach on a 141 GB H200 (140.4 GiB of device
#: memory, less the CUDA context and the allocator's slack).
H200_LIMIT_GIB = 139.0
#: bytes per parameter: bf16 weight, fp32 main_grad, fp32 master weight, Adam's two fp32 moments
STATIC_BYTES_PER_PARAM = 2 + 4 + 4 + 8
#: per-path multiples of N x V bytes at the loss's peak (docs/performance.md)
LOGITS_NV_BYTES = {"native": 6, "native_fused": 10, "ours": 4, "ours_inplace": 2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model of one run (Megatron-LM's flags of the same names)."""

    seq: int
    vocab: int
    layers: int = 4
    hidden: int = 2048
    heads: int = 16
    ffn: Optional[int] = None  # 4 x hidden when None
    micro_batch: int = 1
    attention: str = "sdpa"  # "sdpa" (tools/megatron_lm_sdpa_attention.py) or "local"
    recompute: bool = False  # --recompute-granularity selective (core attention)
    tied: bool = True  # Megatron-LM's default: the embedding is the output layer's weight

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch


def params(m: Shape) -> int:
    """Parameters: embedding (and an untied output layer), layers (QKV, projection, two MLP
    GEMMs with biases, two layer norms), the final norm. Rope: no position table."""
    h, f = m.hidden, m.ffn or 4 * m.hidden
    layer = 4 * h * h + 2 * h * f + 3 * h + h + f + h + 4 * h
    return m.vocab * h * (1 if m.tied else 2) + m.layers * layer + 2 * h


def static_bytes(m: Shape) -> int:
    return STATIC_BYTES_PER_PARAM * params(m)


def activation_bytes(m: Shape) -> int:
    """What the layers, embedding and final norm keep for backward (module docstring)."""
    n, h, a, s, b = m.tokens, m.hidden, m.heads, m.seq, m.micro_batch
    f = m.ffn or 4 * h
    per_layer = 34 * n * h + 2 * n * (f - 4 * h) * 2  # the MLP terms at ffn != 4H
    once = 10 * n * h
    if m.attention == "local":
        scores = 5 * a * s * s * b  # probabilities, dropout mask, dropped probabilities
        once += s * s  # megatron-core's causal mask, bool
        if m.recompute:
            once += scores  # one layer's, while its attention runs (forward or recomputed)
        else:
            per_layer += scores
    else:
        per_layer += 4 * n * h + 4 * a * n
    return m.layers * per_layer + once


def fused_linear_strategy(m: Shape, budget_gib: Optional[float]) -> dict:
    """The fused linear loss's strategy for Megatron-LM's per-token loss with its loss mask,
    chosen by the package's own ``choose_strategy`` on shapes (meta tensors, the Hopper tile
    table), and the bytes it holds beyond its inputs and the gradients it returns."""
    import torch

    from vocab_parallel_loss.kernels import linear as kernels
    from vocab_parallel_loss.kernels.linear import config as lce_config
    from vocab_parallel_loss.ops.fused_linear import strategy as st

    backend = SimpleNamespace(**{k: getattr(kernels, k) for k in
                                 ("STRATEGIES", "saved_bytes", "gif_chunk_rows", "invariant_tiles",
                                  "parts_bytes")})
    backend.default_config = lambda device: lce_config.HOPPER_CONFIG
    n, v, h = m.tokens, m.vocab, m.hidden
    e = torch.empty((n, h), dtype=torch.bfloat16, device="meta", requires_grad=True)
    c = torch.empty((v, h), dtype=torch.bfloat16, device="meta", requires_grad=True)
    budget = None if budget_gib is None else int(budget_gib * GIB)
    with torch.enable_grad():
        s = st.choose_strategy(backend, e, c, None, "none", False, None, None, 0.0, budget,
                               main_grad=False, masked=True)
    cfg = lce_config.HOPPER_CONFIG
    chunk = st.fallback_chunk_bytes(n, v, 2, cfg.chunk_bytes, cfg)  # as backward allocates it
    de_hold, de_round = st.recompute_de_bytes(n, h, 2, True, False)
    if s.name == "saved" and s.size is None:
        held, what = kernels.saved_bytes(n, v, 2, cfg), "saved tiles"
    elif s.name == "saved":
        held = kernels.saved_bytes(n, s.size, 2, cfg) + max(de_hold + chunk, de_round)
        what = f"first {s.size} columns saved, the rest recomputed"
    elif s.name == "grad_in_forward":
        forward, backward = st.masked_gif_bytes(n, v, h, e, c, False, 1, False, s.chunk_bytes or 0)
        held = max(forward + kernels.saved_bytes(s.size, v, 2, cfg), backward)
        what = f"gradients in forward, chunks of {s.size} rows"
    elif s.chunk_bytes is None:
        held, what = max(de_hold + chunk, de_round), "recompute, 128 MiB chunks"
    else:
        narrow = st.fallback_chunk_bytes(n, v, 2, s.chunk_bytes, cfg)
        held = max(de_hold + narrow, de_round)
        what = f"recompute, chunks of {narrow // (n * 2)} columns"
    return dict(strategy=s.name, detail=what, bytes=held)


def returned_gradient_bytes(m: Shape) -> int:
    """The bf16 gradients of the output layer's weight (2VH) and of its input (2NH) that the
    fused linear loss returns. It forms them at the loss (in forward, or at the start of
    backward), while every activation is still held; the logits paths form them in the output
    layer's backward, after their N x V buffers are freed, so they add nothing to those peaks."""
    return 2 * (m.vocab + m.tokens) * m.hidden


def loss_bytes(run: str, m: Shape, budget_gib: Optional[float] = None) -> int:
    """The loss path's bytes at the step's peak beyond what every path holds (module docstring).
    ``run``: a key of ``LOGITS_NV_BYTES`` or ``"fused_linear"`` (what its strategy holds, plus
    the gradients it returns)."""
    if run == "fused_linear":
        return fused_linear_strategy(m, budget_gib)["bytes"] + returned_gradient_bytes(m)
    return LOGITS_NV_BYTES[run] * m.tokens * m.vocab


def peak_bytes(run: str, m: Shape, budget_gib: Optional[float] = None) -> int:
    return static_bytes(m) + activation_bytes(m) + loss_bytes(run, m, budget_gib)


def longest_fit(run: str, m: Shape, limit_gib: float, budget_gib: Optional[float] = None,
                step: int = 1024, top: int = 1 << 21) -> int:
    """The longest sequence (a multiple of ``step``, at most ``top``) whose predicted peak stays
    within ``limit_gib``; 0 when none does."""
    lo, hi = 0, top // step
    while lo < hi:  # the peak grows with the sequence
        mid = (lo + hi + 1) // 2
        if peak_bytes(run, dataclasses.replace(m, seq=mid * step), budget_gib) <= limit_gib * GIB:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def prediction_table(vocabs: Sequence[int], seqs: Sequence[int], runs: Dict[str, tuple],
                     base: dict, limit_gib: float) -> str:
    """Markdown: predicted peak GiB per run and sequence, per vocabulary, and the longest
    sequence each run fits in ``limit_gib``. ``runs``: name -> (model run, budget GiB)."""
    lines = []
    for v in vocabs:
        m0 = Shape(seq=seqs[0], vocab=v, **base)
        lines += [f"V = {v} (static {static_bytes(m0) / GIB:.1f} GiB: {params(m0) / 1e6:.0f}M "
                  f"parameters x {STATIC_BYTES_PER_PARAM} B)", "",
                  "| run | " + " | ".join(str(s) for s in seqs) + f" | longest seq in {limit_gib:g} GiB |",
                  "|---|" + "---:|" * (len(seqs) + 1)]
        for name, (run, budget) in runs.items():
            cells = []
            for s in seqs:
                gib = peak_bytes(run, Shape(seq=s, vocab=v, **base), budget) / GIB
                cells.append(f"{gib:.1f}" + ("" if gib <= limit_gib else " (OOM)"))
            lines.append(f"| {name} | " + " | ".join(cells)
                         + f" | {longest_fit(run, m0, limit_gib, budget)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[151936, 262144])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 16384, 32768, 65536, 98304, 131072, 196608, 262144])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--attention", choices=("sdpa", "local"), default="sdpa")
    p.add_argument("--recompute", action="store_true")
    p.add_argument("--limit-gib", type=float, default=H200_LIMIT_GIB)
    p.add_argument("--small-budget-gib", type=float, default=0.25)
    a = p.parse_args(argv)
    base = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, attention=a.attention, recompute=a.recompute)
    runs = {"native": ("native", None), "native_fused": ("native_fused", None), "ours": ("ours", None),
            "ours_inplace": ("ours_inplace", None), "ours_fused_linear": ("fused_linear", None),
            f"ours_fused_linear@{a.small_budget_gib:g}": ("fused_linear", a.small_budget_gib)}
    print(prediction_table(a.vocab, a.seq, runs, base, a.limit_gib))
    for v in a.vocab:
        for s in a.seq:
            m = Shape(seq=s, vocab=v, **base)
            d = fused_linear_strategy(m, None)
            small = fused_linear_strategy(m, a.small_budget_gib)
            print(f"V={v} seq={s}: activations {activation_bytes(m) / GIB:.1f} GiB; fused linear "
                  f"{d['detail']} {d['bytes'] / GIB:.2f} GiB; @{a.small_budget_gib:g}: {small['detail']} "
                  f"{small['bytes'] / GIB:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
