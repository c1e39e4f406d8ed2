"""torchrun worker for tests/integrations/megatron/test_fp32_head.py: ``--vocab-parallel-loss-fp32-head``
on real megatron-core objects, TP=2 over gloo on CPU.

    torchrun --nproc-per-node 2 tests/integrations/megatron/_fp32_head_worker.py [CHECK ...]

A tiny untied GPTModel is built in fp32 (as Megatron-LM builds it before its conversion) and
made bf16 by megatron-core's own ``Float16Module``; every loss is compared with fp64 cross
entropy of (the bf16 hidden states entering the loss, cast to fp64) @ (the gathered fp32 output
weight, cast to fp64). Outcomes go as JSON to ``$VPL_TORCHRUN_RESULTS`` (``run_checks``).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests._torchrun import end_worker, run_checks  # noqa: E402
from tests.integrations.megatron._worker import (  # noqa: E402
    BATCH, SEQ, TP, VOCAB, batch, build, cpu_sequence_parallel, gather_vocab, setup,
)

#: fp32-class error of the loss against fp64 (a weight rounded to bf16 anywhere: ~1e-3)
LOSS_ABS = 2e-5


def fp32_head_config(fused=True, **kw):
    from vocab_parallel_loss.megatron import VocabParallelLossConfig

    return VocabParallelLossConfig(enabled=True, fused_linear=fused, fp32_head=True, **kw)


def to_bf16(model):
    """Megatron-LM's conversion: ``Float16Module(config, model)`` calls ``model.bfloat16()``."""
    from megatron.core.transformer.module import Float16Module

    model.config.bf16 = True
    return Float16Module(model.config, model)


def labels_and_upstream():
    tokens, pos, labels = batch(0)
    labels = labels.clone()
    labels[0, :3] = -100
    return tokens, pos, labels, torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3))


def forward_capturing(wrapped, inner, *args, **kwargs):
    """``wrapped(*args, **kwargs)``, and the decoder's output (the hidden states entering the
    loss) with its gradient once backward has run."""
    seen = {}

    def keep(_module, _inputs, output):
        seen["hidden"] = output
        if output.requires_grad:
            output.register_hook(lambda g: seen.__setitem__("grad", g))

    handle = inner.decoder.register_forward_hook(keep)
    try:
        return wrapped(*args, **kwargs), seen
    finally:
        handle.remove()


def fp64_reference(hidden, weight, labels, upstream, group):
    """Per-token loss ``[b, s]`` in fp64 of ``hidden [s, b, h]`` (as given) @ the gathered weight;
    and the gradients of this rank's weight rows and of the hidden states."""
    parts = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, weight.detach().contiguous(), group=group)
    w = torch.cat(parts).double().requires_grad_()
    h = hidden.detach().double().requires_grad_()
    logits = (h @ w.t()).transpose(0, 1)  # [b, s, V]
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none",
                           ignore_index=-100).view(BATCH, SEQ)
    (loss * upstream.double()).sum().backward()
    rank, rows = dist.get_rank(group), weight.size(0)
    return loss.detach(), w.grad[rank * rows:(rank + 1) * rows], h.grad


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def check_conversion_and_loss(ps):
    """With the flag: after Float16Module the output weight is fp32 and every other parameter
    bf16; the loss (fused, and from materialized fp32 logits) and the gradients of the output
    weight and of the hidden states equal the fp64 reference; inference logits are fp32. Without
    it: every parameter bf16, the output layer megatron-core's own class."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from vocab_parallel_loss.megatron import VocabParallelLossConfig, attach_vocab_parallel_loss

    group = ps.get_tensor_model_parallel_group()
    tokens, pos, labels, upstream = labels_and_upstream()
    out = {}
    for name, fused, via_attach in (("fused", True, True), ("logits", False, False)):
        cfg = fp32_head_config(fused=fused)
        inner = (attach_vocab_parallel_loss(build(None, cls=GPTModel, tied=False), cfg) if via_attach
                 else build(cfg, tied=False))
        model = to_bf16(inner)
        model.to("cpu")  # a device move keeps it fp32 too
        weight = inner.output_layer.weight
        assert weight.dtype == torch.float32, (name, weight.dtype)
        others = {n: p.dtype for n, p in inner.named_parameters() if not n.startswith("output_layer.")}
        assert others and set(others.values()) == {torch.bfloat16}, (name, others)
        ran = []
        inner.output_layer.register_forward_hook(lambda _m, _i, o: ran.append(o[0].dtype))
        loss, seen = forward_capturing(model, inner, tokens, pos, None, labels=labels)
        assert ran == ([] if fused else [torch.float32]), (name, ran)
        hidden = seen["hidden"]
        assert hidden.dtype == torch.bfloat16 and loss.dtype == torch.float32, (name, hidden.dtype, loss.dtype)
        (loss * upstream).sum().backward()
        ref, ref_dw, ref_dh = fp64_reference(hidden, weight, labels, upstream, group)
        out[f"{name}_loss_err"] = err(loss, ref)
        assert out[f"{name}_loss_err"] <= LOSS_ABS, out
        assert weight.grad.dtype == torch.float32
        out[f"{name}_dw_rel_err"] = err(weight.grad, ref_dw) / ref_dw.abs().max().item()
        assert out[f"{name}_dw_rel_err"] <= 1e-4, out
        # the hidden states' gradient comes back in bf16: one rounding (2**-8 relative)
        out[f"{name}_dh_rel_err"] = err(seen["grad"], ref_dh) / ref_dh.abs().max().item()
        assert seen["grad"].dtype == torch.bfloat16 and out[f"{name}_dh_rel_err"] <= 1e-2, out
        assert all(p.grad is not None for p in inner.parameters()), f"{name}: a parameter got no gradient"
        if fused:  # inference (no labels): the output layer's logits, fp32, from the hidden cast to fp32
            with torch.no_grad():
                logits, seen = forward_capturing(model, inner, tokens, pos, None)
            want = (seen["hidden"].float() @ weight.t()).transpose(0, 1)
            assert logits.dtype == torch.float32 and err(logits, want) <= 1e-5, (logits.dtype, err(logits, want))

    # Without the flag: megatron-core's conversion as before.
    inner = build(VocabParallelLossConfig(enabled=True, fused_linear=True), tied=False)
    model = to_bf16(inner)
    assert type(inner.output_layer) is ColumnParallelLinear
    assert {p.dtype for p in inner.parameters()} == {torch.bfloat16}
    loss = model(tokens, pos, None, labels=labels)
    out["no_flag_loss_vs_fp32_head"] = (loss - ref.float()).abs().max().item()
    assert torch.isfinite(loss).all() and out["no_flag_loss_vs_fp32_head"] > 10 * LOSS_ABS, out  # a bf16 weight
    return out


def check_sequence_parallel_main_grad(ps):
    """Sequence parallelism, megatron-core's DistributedDataParallel (grad buffers by dtype) and
    gradient-accumulation fusion: the output weight sits in an fp32 buffer with an fp32
    ``main_grad``, into which the fused loss adds its gradient; against the fp64 reference."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    group = ps.get_tensor_model_parallel_group()
    tokens, pos, labels, upstream = labels_and_upstream()
    with cpu_sequence_parallel():
        inner = build(fp32_head_config(memory_budget_gib=0.0), tied=False, sequence_parallel=True)
        model = to_bf16(inner)
        ddp = DistributedDataParallel(inner.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                      module=model)
        weight = inner.output_layer.weight
        buffers = {(b.param_dtype, b.grad_dtype): b for b in ddp.buffers}
        fp32 = buffers.get((torch.float32, torch.float32))
        assert fp32 is not None and [p is weight for p in fp32.params] == [True], buffers.keys()
        assert weight.main_grad.dtype == torch.float32 and weight.dtype == torch.float32
        inner.config.gradient_accumulation_fusion = True  # read by the fused loss at each call
        loss, seen = forward_capturing(ddp, inner, tokens, pos, None, labels=labels)
        (loss * upstream).sum().backward()
        assert weight.grad_added_to_main_grad, "the fused loss did not add into main_grad"
        # the hidden states are this rank's sequence shard: gather them for the reference
        parts = [torch.empty_like(seen["hidden"]) for _ in range(TP)]
        dist.all_gather(parts, seen["hidden"].detach().contiguous(), group=group)
        ref, ref_dw, _ = fp64_reference(torch.cat(parts), weight, labels, upstream, group)
    out = {"loss_err": err(loss, ref), "dw_rel_err": err(weight.main_grad, ref_dw) / ref_dw.abs().max().item()}
    assert out["loss_err"] <= LOSS_ABS and out["dw_rel_err"] <= 1e-4, out
    return out


def check_checkpoint(ps):
    """The fp32 weight is saved and loaded as fp32 (state_dict through Float16Module, and the
    sharded state dict of distributed checkpointing)."""
    inner = build(fp32_head_config(), tied=False, seed=1)
    model = to_bf16(inner)
    state = model.state_dict()
    assert state["output_layer.weight"].dtype == torch.float32
    sharded = inner.sharded_state_dict()
    assert sharded["output_layer.weight"].data.dtype == torch.float32
    with torch.no_grad():  # values only fp32 holds
        inner.output_layer.weight.add_(torch.full_like(inner.output_layer.weight, 2.0 ** -20))
    blob = io.BytesIO()
    torch.save(model.state_dict(), blob)
    other_inner = build(fp32_head_config(), tied=False, seed=2)
    other = to_bf16(other_inner)
    blob.seek(0)
    other.load_state_dict(torch.load(blob))
    loaded = other_inner.output_layer.weight
    assert loaded.dtype == torch.float32 and torch.equal(loaded, inner.output_layer.weight)
    other.half()  # fp16 too
    assert loaded.dtype == torch.float32
    assert {p.dtype for n, p in other_inner.named_parameters() if n != "output_layer.weight"} == {torch.float16}
    return {}


def check_mtp(ps):
    """Multi-token prediction heads on the fp32 head (bf16 model): the fused path's main loss,
    logged head losses and output-weight gradient equal the unfused path's (fp32 logits)."""
    import dataclasses

    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from tests.integrations.megatron._worker import build_mtp, tiny_config

    if "mtp_num_layers" not in {f.name for f in dataclasses.fields(tiny_config())}:
        return {"skipped": "this megatron-core has no multi-token prediction"}
    tokens, pos, labels, upstream = labels_and_upstream()
    labels[labels < 0] = 0
    results = []
    for fused in (True, False):
        inner = build_mtp(fp32_head_config(fused=fused), tied=False, sequence_parallel=False)
        model = to_bf16(inner)
        assert inner.output_layer.weight.dtype == torch.float32
        MTPLossLoggingHelper.tracker.clear()
        with cpu_sequence_parallel():  # megatron-core's MTP gathers onto torch.cuda.current_device()
            loss = model(tokens, pos, None, labels=labels, loss_mask=torch.ones(BATCH, SEQ))
            logged = MTPLossLoggingHelper.tracker["values"].clone()
            (loss * upstream).sum().backward()
        results.append((loss.detach(), logged, inner.output_layer.weight.grad.clone()))
    MTPLossLoggingHelper.tracker.clear()
    (loss, logged, dw), (ref, ref_logged, ref_dw) = results
    out = {"loss_err": err(loss, ref), "logged_err": err(logged, ref_logged),
           "dw_rel_err": err(dw, ref_dw) / ref_dw.abs().max().item()}
    assert out["loss_err"] <= 1e-5 and out["logged_err"] <= 1e-5 and out["dw_rel_err"] <= 1e-4, out
    return out


def check_errors(ps):
    """Tied embeddings, the flag without --vocab-parallel-loss, a model already under DDP, and
    the output processor given a 16-bit weight: clear errors naming the way out."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from vocab_parallel_loss.megatron import (
        VocabParallelLossConfig, VocabParallelLossOutputProcessor, keep_output_layer_fp32,
    )

    out = {}
    try:
        build(fp32_head_config(), tied=True)
        raise AssertionError("tied embeddings were accepted")
    except ValueError as e:
        out["tied"] = str(e)
    assert "--untie-embeddings-and-output-weights" in out["tied"] and "--vocab-parallel-loss-fp32-head" in out["tied"]
    try:
        VocabParallelLossConfig(fp32_head=True)
        raise AssertionError("fp32_head without enabled was accepted")
    except ValueError as e:
        assert "--vocab-parallel-loss" in str(e)
    try:
        VocabParallelLossConfig(enabled=True, fp32_precision="fp16")
        raise AssertionError("fp32_precision='fp16' was accepted")
    except ValueError as e:
        assert "fp32_precision" in str(e)
    plain = build(None, cls=GPTModel, tied=False)
    plain.output_layer.weight.main_grad = torch.zeros_like(plain.output_layer.weight)
    try:
        keep_output_layer_fp32(plain)
        raise AssertionError("a model under DDP was accepted")
    except RuntimeError as e:
        assert "before DDP" in str(e), e
    # the output processor (megatron-core's own model class): a bf16 weight, the hook not used
    plain = to_bf16(build(None, cls=GPTModel, tied=False)).module
    processor = VocabParallelLossOutputProcessor(fp32_head_config())
    hidden = torch.zeros(SEQ, BATCH, plain.config.hidden_size, dtype=torch.bfloat16)
    try:
        processor(hidden_states=hidden, output_layer=plain.output_layer, labels=labels_and_upstream()[2],
                  config=plain.config, compute_language_model_loss=plain.compute_language_model_loss)
        raise AssertionError("a bf16 output weight was accepted under fp32_head")
    except RuntimeError as e:
        out["processor"] = str(e)
    assert "pre_wrap_hooks.append(keep_output_layer_fp32)" in out["processor"], out
    return out


def check_output_processor(ps):
    """megatron-core's own GPTModel with ``keep_output_layer_fp32`` (the pre-wrap hook) and the
    output processor (called as megatron-core >= 0.18 calls it): the fused loss, and the loss of
    fp32 logits, equal the fp64 reference."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from vocab_parallel_loss.megatron import VocabParallelLossOutputProcessor, keep_output_layer_fp32

    group = ps.get_tensor_model_parallel_group()
    _, _, labels, upstream = labels_and_upstream()
    [model] = keep_output_layer_fp32([to_bf16(build(None, cls=GPTModel, tied=False))])
    inner = model.module
    weight = inner.output_layer.weight
    assert weight.dtype == torch.float32
    g = torch.Generator().manual_seed(5)
    out = {}
    for fused in (True, False):
        hidden = torch.randn(SEQ, BATCH, inner.config.hidden_size, generator=g).bfloat16().requires_grad_()
        processor = VocabParallelLossOutputProcessor(fp32_head_config(fused=fused))
        loss = processor(hidden_states=hidden, output_layer=inner.output_layer, labels=labels,
                         config=inner.config, compute_language_model_loss=inner.compute_language_model_loss)
        ref, _, _ = fp64_reference(hidden, weight, labels, upstream, group)
        out[f"fused{int(fused)}_loss_err"] = err(loss, ref)
        assert out[f"fused{int(fused)}_loss_err"] <= LOSS_ABS, out
    return out


CHECKS = {
    "conversion_and_loss": check_conversion_and_loss,
    "sequence_parallel_main_grad": check_sequence_parallel_main_grad,
    "checkpoint": check_checkpoint,
    "errors": check_errors,
    "output_processor": check_output_processor,
    "mtp": check_mtp,
}


def main():
    names = sys.argv[1:] or list(CHECKS)
    ps = setup()
    run_checks([(name, lambda name=name: CHECKS[name](ps)) for name in names], keep_going=True,
               summary="fp32 head checks passed")
    ps.destroy_model_parallel()
    end_worker()  # no interpreter finalization: see tests/_torchrun.py


if __name__ == "__main__":
    main()
