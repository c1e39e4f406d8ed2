"""torchrun worker (2 ranks, gloo): the verl-style megatron-core ``output_processor`` on a real
megatron-core ``ColumnParallelLinear`` output layer with sequence parallelism, against the fp64
oracle on the gathered weight and hidden states. Reports through ``run_checks``
(tests/_torchrun.py): prints ``1 output_processor cases passed on 2 ranks``, and rank 0 writes
the outcome as JSON when launched by the tests."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tests._logprobs_oracle import oracle
from tests._torchrun import end_worker, run_checks

SEQ, BATCH, HIDDEN, VOCAB = 6, 3, 16, 42


def check_output_processor():
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from vocab_parallel_loss.verl import output_processor

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                              use_cpu_initialization=True, params_dtype=torch.float32)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=cfg, init_method=torch.nn.init.normal_,
                                 bias=False, gather_output=False, skip_bias_add=False)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[0, 2] = -100
    temp = torch.rand(BATCH, SEQ, generator=g) + 0.5
    g_lp, g_ent = torch.randn(BATCH, SEQ, generator=g), torch.randn(BATCH, SEQ, generator=g)
    rows = slice(rank * SEQ // world, (rank + 1) * SEQ // world)
    mine = hidden[rows].float().requires_grad_()
    out = output_processor(hidden_states=mine, output_layer=layer, output_weight=None,
                           labels=labels, loss_mask=None, context={"temperature": temp},
                           config=cfg, compute_language_model_loss=None)
    full_w = [torch.empty_like(layer.weight) for _ in range(world)]
    dist.all_gather(full_w, layer.weight.detach().contiguous())
    w64 = torch.cat(full_w).double().requires_grad_()
    h64 = hidden.clone().requires_grad_()
    lp, ent, _ = oracle((h64 @ w64.t()).transpose(0, 1), labels, temp)
    for name, got, want in (("log_probs", out["log_probs"], lp), ("entropy", out["entropy"], ent)):
        assert got.shape == (BATCH, SEQ), (name, got.shape)
        err = (got.double() - want.detach()).abs().max().item()
        assert err < 1e-4 * max(1.0, want.abs().max().item()), (name, err)
    ((out["log_probs"] * g_lp).sum() + (out["entropy"] * g_ent).sum()).backward()
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    v_local = VOCAB // world
    for name, got, want in (("dW", layer.weight.grad, w64.grad[rank * v_local:(rank + 1) * v_local]),
                            ("dH", mine.grad, h64.grad[rows])):
        err = (got.double() - want).abs().max().item()
        assert err < 1e-4 * max(1.0, want.abs().max().item()), (name, err)
    parallel_state.destroy_model_parallel()


def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    run_checks([("output_processor", check_output_processor)],
               summary="output_processor cases passed")
    dist.barrier()
    end_worker()  # no interpreter finalization: see tests/_torchrun.py


if __name__ == "__main__":
    main()
