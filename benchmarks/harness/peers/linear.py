"""Fused linear cross entropy: this package (per strategy and memory budget) and its peers.

``make_peer(name)`` returns ``fn(e, c, t, reduction) -> (loss, leaves)`` for hidden states e
(N, H), the output layer's weight c (V, H) and targets t (N,): the loss, and the tensors whose
gradients the step asks for. A peer that is not installed raises on ``make_peer`` (ImportError).

The step's reductions (``make_step``): ``"mean"``, ``"none"`` (a per-token upstream gradient) and
``"masked"``, Megatron's loss: per-token losses times a loss mask, summed and divided by the
mask's count. Ours takes the mask with it (``fn.takes_loss_mask``: ``fn(e, c, t, "none",
loss_mask)``) and can form its gradients in forward; the others compute per-token losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GiB = 2**30


def make_ours(impl="triton", memory_budget=None, main_grad=False):
    """Ours; with ``main_grad`` the weight's gradient is added into an fp32 ``c.main_grad``
    (megatron-core's gradient-accumulation fusion): only dE is returned, and that buffer, which
    such a trainer holds anyway, counts as an input."""
    from vocab_parallel_loss import linear_cross_entropy

    def fn(e, c, t, red, loss_mask=None):
        if main_grad and getattr(c, "main_grad", None) is None:
            c.main_grad = torch.zeros(c.shape, dtype=torch.float32, device=c.device)
            c.grad_added_to_main_grad = False
        return linear_cross_entropy(e, c, t, reduction=red, impl=impl,
                                    memory_budget=memory_budget,
                                    gradient_accumulation_fusion=main_grad,
                                    loss_mask=loss_mask), \
            (e,) if main_grad else (e, c)
    fn.takes_loss_mask = True
    return fn


def make_ours_strategy(strategy):
    """Ours forced to one strategy (``LCEConfig.strategy``): ``saved`` (6NHV, the logits tiles
    held until backward), ``grad_in_forward`` (scalar losses; 6NHV, fp32 dC) or ``recompute``
    (8NHV, memory independent of V)."""
    from vocab_parallel_loss import linear_cross_entropy
    from vocab_parallel_loss.kernels.linear import config as C

    def fn(e, c, t, red, loss_mask=None):
        if strategy == "grad_in_forward" and red == "none" and loss_mask is None:
            raise ValueError("grad_in_forward applies to scalar losses and masked ones only")
        saved = C.OVERRIDE_CONFIG
        C.OVERRIDE_CONFIG = C.default_config(e.device).replace(strategy=strategy)
        try:
            return linear_cross_entropy(e, c, t, reduction=red, impl="triton",
                                        loss_mask=loss_mask), (e, c)
        finally:
            C.OVERRIDE_CONFIG = saved
    fn.takes_loss_mask = True
    return fn


def make_ours_logits():
    """The logits path of a Megatron model with this package's loss: cuBLAS's bf16 logits, then
    ``cross_entropy`` over them (what the fused linear loss replaces)."""
    from vocab_parallel_loss import cross_entropy

    def fn(e, c, t, red):
        return cross_entropy(e @ c.t(), t, reduction=red), (e, c)
    return fn


def make_torch():
    def fn(e, c, t, red):
        return F.cross_entropy((e @ c.t()).float(), t, reduction=red), (e, c)
    return fn


def make_cce():
    from cut_cross_entropy import linear_cross_entropy as cce

    def fn(e, c, t, red):
        return cce(e, c, t, reduction=red), (e, c)
    return fn


def make_liger():
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    mods = {}

    def fn(e, c, t, red):
        if red not in mods:
            mods[red] = LigerFusedLinearCrossEntropyLoss(reduction=red)
        return mods[red](c, e, t), (e, c)
    return fn


PEER_NOTES = []  # what a peer needed to run here (printed with the table)


def make_quack():
    from quack.linear_cross_entropy import LinearCrossEntropy

    mods = {}

    def build(c, red, chunk):
        m = LinearCrossEntropy(c.shape[1], c.shape[0], bias=False, reduction=red,
                               chunk_size=chunk if red != "none" else None,
                               device=c.device, dtype=c.dtype)
        m.weight = torch.nn.Parameter(c.detach(), requires_grad=True)  # shares storage
        return m

    def fn(e, c, t, red):
        key = (red, c.data_ptr())
        if key not in mods:
            m = build(c, red, 4096)
            try:
                m(e, t)
            except ValueError as ex:
                # quack 0.6.4 cannot tell a row vector from a column vector in its GEMM
                # epilogue when the chunk's two sizes are equal (chunk 4096 at V=128256)
                if "ambiguous" not in str(ex) or red == "none":
                    raise
                m = build(c, red, 8192)
                PEER_NOTES.append(f"quack V={c.shape[0]} {red}: chunk_size 8192, not 4096 "
                                  f"({str(ex)[:120]})")
            mods[key] = m
        m = mods[key]
        return m(e, t), (e, m.weight)
    return fn


PEERS = {
    "ours": make_ours,
    "ours_saved": lambda: make_ours_strategy("saved"),
    "ours_gif": lambda: make_ours_strategy("grad_in_forward"),
    "ours_recompute": lambda: make_ours_strategy("recompute"),
    "ours_torch_impl": lambda: make_ours("torch"),
    "ours_main_grad": lambda: make_ours(main_grad=True),
    "ours_logits": make_ours_logits,
    "torch": make_torch,
    "cce": make_cce,
    "liger": make_liger,
    "quack": make_quack,
}


def known(name: str) -> bool:
    """A name ``make_peer`` takes."""
    base, _, budget = name.partition("@")
    if name in PEERS:
        return True
    try:
        float(budget)
    except ValueError:
        return False
    return base in ("ours", "ours_main_grad")


def make_peer(name: str):
    """``PEERS[name]``, or ``ours@G`` / ``ours_main_grad@G``: ours with ``memory_budget`` of G
    GiB (a point of the time-memory front between the strategies)."""
    base, _, budget = name.partition("@")
    if budget and base in ("ours", "ours_main_grad"):
        return make_ours(memory_budget=float(budget) * GiB, main_grad=base == "ours_main_grad")
    return PEERS[name]()


def make_inputs(device, n: int, h: int, v: int, grad: bool = True):
    """The inputs of one shape, seeded: bf16 e (N, H) and c (V, H) (leaves that require grad
    with ``grad``), targets t (N,) and a non-uniform fp32 upstream gradient up (N,) in
    [0.5, 1.5)."""
    g = torch.Generator(device=device).manual_seed(0)
    e = (torch.randn(n, h, device=device, generator=g) * 0.5).bfloat16().requires_grad_(grad)
    c = (torch.randn(v, h, device=device, generator=g) * 0.02).bfloat16().requires_grad_(grad)
    t = torch.randint(0, v, (n,), device=device, generator=g)
    up = torch.rand(n, device=device, generator=g) + 0.5
    return e, c, t, up


def loss_mask(t):
    """The ``"masked"`` step's loss mask: every seventh token masked out (fp32, like Megatron's)."""
    return (torch.arange(t.numel(), device=t.device) % 7 != 0).float().view(t.shape)


def make_step(fn, e, c, t, red, up):
    """``step() -> (loss, gradients)`` of a peer ``fn``: backward under the upstream gradient
    ``up`` for per-token losses, the implicit 1 for scalar ones; for ``"masked"`` the per-token
    losses times ``loss_mask(t)``, summed and divided by its count, as Megatron-LM's loss
    function and schedule do (the module docstring)."""
    if red == "masked":
        mask = loss_mask(t)

        def step():
            if getattr(fn, "takes_loss_mask", False):
                loss, leaves = fn(e, c, t, "none", mask)
            else:
                loss, leaves = fn(e, c, t, "none")
            total = torch.sum(loss.float().view(-1) * mask.view(-1)) / mask.sum()
            return loss, torch.autograd.grad(total, leaves)
        return step

    def step():
        loss, leaves = fn(e, c, t, red)
        g = up if red == "none" else None
        return loss, torch.autograd.grad(loss, leaves, g)
    return step
