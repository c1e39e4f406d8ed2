"""torch.compile traces the loss as registered ops: no graph break, same result as eager."""

from __future__ import annotations

import pytest
import torch

from tests._oracle import full_vocab_loss_and_grad
from vocab_parallel_loss import VocabParallelCrossEntropy


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_compiled_step_has_no_graph_break_and_matches(reduction):
    torch._dynamo.reset()
    head = torch.nn.Linear(16, 37, bias=False)
    loss_fn = VocabParallelCrossEntropy(label_smoothing=0.1, reduction=reduction)
    h = torch.randn(4, 3, 16)
    target = torch.randint(0, 37, (4, 3))
    target[0, 0] = -100

    def step(h, target):
        loss = loss_fn(head(h), target)
        return loss.sum() if reduction == "none" else loss

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: break = error
    loss = compiled(h, target)
    (grad,) = torch.autograd.grad(loss, head.weight)
    logits = head(h).detach()
    ref_loss, ref_dlogits = full_vocab_loss_and_grad(logits, target, label_smoothing=0.1,
                                                     reduction=reduction)
    torch.testing.assert_close(loss.double(), ref_loss.sum(), atol=1e-5, rtol=1e-5)
    ref_grad = torch.einsum("sbv,sbh->vh", ref_dlogits, h.double())
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=1e-4)


def test_registered_ops_pass_opcheck():
    from vocab_parallel_loss.ops.cross_entropy import compiled as ops

    logits = torch.randn(5, 23, requires_grad=True)
    target = torch.randint(0, 23, (5,))
    torch.library.opcheck(ops.ce_forward, (logits, target, "", -100, 0.1, 1e-3))
    loss, lse = ops.ce_forward(logits, target, "", -100, 0.1, 1e-3)
    torch.library.opcheck(ops.ce_backward, (logits.detach(), target, lse.detach(), torch.rand(5), "", -100,
                                            0.1, 1e-3))
