"""torchrun worker for tests/integrations/megatron: TP=2 over gloo on CPU, tiny shapes.

    torchrun --nproc-per-node 2 tests/integrations/megatron/_worker.py [CHECK ...]

Runs each check, catches its failure, and rank 0 writes {check: {"ok": bool, "error": str, ...}}
as JSON to ``$VPL_TORCHRUN_RESULTS`` (``run_checks`` in tests/_torchrun.py). Every comparison is against an independent reference: megatron-core's own loss path,
or fp64 ``torch.nn.functional.cross_entropy`` on the all-gathered full-vocabulary logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests._torchrun import end_worker, run_checks  # noqa: E402

TP = 2
VOCAB = 256  # 128 columns per rank
SEQ, BATCH, HIDDEN, HEADS, LAYERS = 16, 2, 32, 4, 2
STEPS = 10


def setup():
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    return parallel_state


def tiny_config(tp=TP, pp=1, sequence_parallel=False):
    from vocab_parallel_loss.megatron import _compat

    return _compat.transformer_config(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        cross_entropy_loss_fusion=False,
    )


class SequenceParallelTorchNorm:
    """torch LayerNorm / RMSNorm that megatron-core's ``WrappedTorchNorm`` would build, allowed under
    sequence parallelism (test scaffolding): its parameters carry ``sequence_parallel`` like
    megatron-core's fused norms, whose gradients Megatron all-reduces over TP."""

    def __new__(cls, config, hidden_size, eps=1e-5, **_):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", config.sequence_parallel)
        return norm


def layer_spec(sequence_parallel=False):
    """The SDPA local GPT spec; with sequence parallelism, a block spec with norms that allow it."""
    from vocab_parallel_loss.megatron.layer_specs import sdpa_gpt_layer_spec

    spec = sdpa_gpt_layer_spec()
    if not sequence_parallel:
        return spec
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(spec.submodules, name, IdentityOp) is not IdentityOp:
            setattr(spec.submodules, name, SequenceParallelTorchNorm)
    return TransformerBlockSubmodules(layer_specs=[spec] * LAYERS, layer_norm=SequenceParallelTorchNorm)


def build(loss_config, seed=1234, cls=None, parallel_output=True, tied=True, sequence_parallel=False):
    """A tiny GPTModel; CPU initialization makes the weights the same for the same seed."""
    from vocab_parallel_loss.megatron import VocabParallelLossGPTModel

    torch.manual_seed(seed)
    kwargs = dict(config=tiny_config(sequence_parallel=sequence_parallel),
                  transformer_layer_spec=layer_spec(sequence_parallel),
                  vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied,
                  parallel_output=parallel_output)
    if cls is not None:
        return cls(**kwargs)
    return VocabParallelLossGPTModel(loss_config=loss_config, **kwargs)


def batch(step):
    g = torch.Generator().manual_seed(100 + step % 2)  # same on every rank; two batches to learn
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    return tokens[:, :-1].contiguous(), pos, tokens[:, 1:].contiguous()


def gather_vocab(local, group):
    """Concatenate the vocab shards of ``local (..., V/tp)`` in rank order (autograd-free)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def close(name, a, b, atol, rtol=0.0):
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    tol = atol + rtol * b.double().abs().max().item()
    if not err <= tol:
        raise AssertionError(f"{name}: max abs diff {err:.3e} > {tol:.3e}")
    return err


# ---------------------------------------------------------------------------------------- checks
def check_holds_loss(ps):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from vocab_parallel_loss import VocabParallelCrossEntropy
    from vocab_parallel_loss.megatron import (
        VocabParallelLossConfig,
        VocabParallelLossGPTModel,
        attach_vocab_parallel_loss,
        wrap_model_provider,
    )

    cfg = VocabParallelLossConfig(enabled=True, label_smoothing=0.1, z_loss=1e-4)
    model = build(cfg)
    assert isinstance(model, GPTModel)
    assert isinstance(model.vocab_parallel_loss, VocabParallelCrossEntropy), type(model.vocab_parallel_loss)
    assert "vocab_parallel_loss" in dict(model.named_children()), "the loss must be a registered submodule"
    group = model.vocab_parallel_loss.tp_group
    assert group is not None, "the loss must run on the model's TP group, not as a single shard"
    expected = ps.get_tensor_model_parallel_group()
    assert dist.get_process_group_ranks(group) == dist.get_process_group_ranks(expected)
    assert model.vocab_parallel_loss.label_smoothing == 0.1 and model.vocab_parallel_loss.z_loss == 1e-4
    assert not any(k.startswith("vocab_parallel_loss") for k in model.state_dict()), "no checkpoint entries"
    off = build(VocabParallelLossConfig(enabled=False))
    assert off.vocab_parallel_loss is None
    plain = build(None, cls=GPTModel)
    same = attach_vocab_parallel_loss(plain, VocabParallelLossConfig(enabled=True))
    assert same is plain and isinstance(plain, VocabParallelLossGPTModel)
    assert isinstance(plain.vocab_parallel_loss, VocabParallelCrossEntropy)
    # The Megatron-LM model-provider wrapper.
    provider = wrap_model_provider(lambda pre_process=True, post_process=True: build(None, cls=GPTModel),
                                   VocabParallelLossConfig(enabled=True, z_loss=1e-3))
    wrapped = provider(pre_process=True, post_process=True)
    assert isinstance(wrapped, GPTModel) and isinstance(wrapped.vocab_parallel_loss, VocabParallelCrossEntropy)
    assert wrapped.vocab_parallel_loss.z_loss == 1e-3
    return {}


def check_loss_matches_native(ps):
    """compute_language_model_loss vs megatron-core's vocab_parallel_cross_entropy (loss, dlogits),
    and vs fp64 full-vocabulary F.cross_entropy with label smoothing and z-loss."""
    from megatron.core import tensor_parallel

    from vocab_parallel_loss.megatron import VocabParallelLossConfig

    group = ps.get_tensor_model_parallel_group()
    rank = ps.get_tensor_model_parallel_rank()
    out = {}
    g = torch.Generator().manual_seed(7)
    full = torch.randn(SEQ, BATCH, VOCAB, generator=g) * 3  # same on every rank
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    upstream = torch.rand(BATCH, SEQ, generator=g)
    local = full[..., rank * (VOCAB // TP):(rank + 1) * (VOCAB // TP)].contiguous()

    model = build(VocabParallelLossConfig(enabled=True))
    x = local.clone().requires_grad_(True)
    seen = []  # the loss must get the output layer's logits as they are: no copy, no transpose
    inner = model.vocab_parallel_loss.forward
    model.vocab_parallel_loss.forward = lambda lg, t: (seen.append((lg.data_ptr(), lg.stride())), inner(lg, t))[1]
    loss = model.compute_language_model_loss(labels, x)
    assert seen == [(x.data_ptr(), x.stride())], (seen, x.data_ptr(), x.stride())
    assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32, (loss.shape, loss.dtype)
    loss.backward(upstream)

    y = local.clone().requires_grad_(True)
    ref = tensor_parallel.vocab_parallel_cross_entropy(y, labels.t().contiguous()).t()
    ref.backward(upstream)
    out["loss_vs_native"] = close("loss vs megatron-core", loss, ref, 1e-5, 1e-6)
    out["grad_vs_native"] = close("dlogits vs megatron-core", x.grad, y.grad, 1e-6)

    # In-place backward: the gradient lands in the logits buffer, and is still megatron-core's.
    model = build(VocabParallelLossConfig(enabled=True, inplace_backward=True))
    leaf = local.clone().requires_grad_(True)
    x = leaf * 1.0  # a non-leaf buffer, as the output layer's logits are
    model.compute_language_model_loss(labels, x).backward(upstream)
    out["inplace_grad_vs_native"] = close("in-place dlogits vs megatron-core", leaf.grad, y.grad, 1e-6)

    # Label smoothing (global V, PyTorch's convention) and z-loss vs fp64 F.cross_entropy.
    a, z = 0.1, 1e-3
    model = build(VocabParallelLossConfig(enabled=True, label_smoothing=a, z_loss=z))
    x = local.clone().requires_grad_(True)
    loss = model.compute_language_model_loss(labels, x)
    loss.backward(upstream)
    f = full.double().permute(1, 0, 2).requires_grad_(True)  # [b, s, V]
    ref = F.cross_entropy(f.reshape(-1, VOCAB), labels.reshape(-1), reduction="none", label_smoothing=a)
    ref = ref.view(BATCH, SEQ) + z * torch.logsumexp(f, -1) ** 2
    ref.backward(upstream.double())
    out["smoothing_loss_vs_fp64"] = close("smoothed loss vs fp64", loss, ref, 1e-5, 1e-6)
    grad_full = gather_vocab(x.grad, group)
    out["smoothing_grad_vs_fp64"] = close("smoothed dlogits vs fp64", grad_full, f.grad.permute(1, 0, 2), 1e-6)

    # parallel_output=False: the output layer gathers the vocabulary, so every rank holds it all.
    model = build(VocabParallelLossConfig(enabled=True), parallel_output=False)
    loss = model.compute_language_model_loss(labels, full.clone())
    ref = F.cross_entropy(full.double().permute(1, 0, 2).reshape(-1, VOCAB), labels.reshape(-1),
                          reduction="none").view(BATCH, SEQ)
    out["gathered_loss_vs_fp64"] = close("loss of gathered logits vs fp64", loss, ref, 1e-5, 1e-6)
    return out


def named_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def with_main_grads(model):
    """What megatron-core's DistributedDataParallel does to the parameters for gradient
    accumulation (its buffers need CUDA, so without them): an fp32 ``main_grad`` per parameter,
    ``grad_added_to_main_grad = False`` and megatron-core's own backward post-hook on each
    gradient accumulator, which adds ``.grad`` into ``main_grad`` unless a layer already did."""
    from types import SimpleNamespace

    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    params = [p for p in model.parameters() if p.requires_grad]
    ddp = SimpleNamespace(param_to_bucket_group={p: None for p in params},
                          ddp_config=SimpleNamespace(overlap_grad_reduce=False))
    model.config.gradient_accumulation_fusion = True
    model._grad_accs = []
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
        p.grad_added_to_main_grad = False
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(DistributedDataParallel._make_backward_post_hook(ddp, p))
        model._grad_accs.append(acc)  # the hooks live as long as the accumulators
    return model


def named_main_grads(model):
    return {n: p.main_grad.clone() for n, p in model.named_parameters() if p.main_grad.any()}


def check_model_and_curve(ps):
    """Full GPTModel forward+backward: our loss vs the native path, then 10 AdamW steps."""
    from vocab_parallel_loss.megatron import VocabParallelLossConfig

    ours = build(VocabParallelLossConfig(enabled=True))
    native = build(VocabParallelLossConfig(enabled=False))
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), native.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), f"initial weights differ at {n1}"
    assert ours.vocab_parallel_loss is not None and native.vocab_parallel_loss is None
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, native)]
    out = {"curve_ours": [], "curve_native": []}
    for step in range(STEPS):
        tokens, pos, labels = batch(step)
        losses = []
        for model, opt in zip((ours, native), opts):
            per_token = model(tokens, pos, None, labels=labels)
            assert per_token.shape == (BATCH, SEQ), per_token.shape
            loss = per_token.mean()
            loss.backward()
            losses.append((per_token.detach(), loss.item()))
        if step == 0:  # recorded apart from the curve: the forward/backward test reads it
            try:
                out["fwd_loss_diff"] = close("per-token loss, full model", losses[0][0], losses[1][0], 1e-5, 1e-6)
                g_ours, g_native = named_grads(ours), named_grads(native)
                n_params = len(list(ours.parameters()))
                assert g_ours.keys() == g_native.keys() and len(g_ours) == n_params, "missing gradients"
                worst = 0.0
                for name in g_ours:
                    scale = g_native[name].abs().max().item()
                    worst = max(worst, close(f"grad of {name}", g_ours[name], g_native[name], 1e-6 + 1e-4 * scale))
                out["param_grad_max_diff"] = worst
                out["n_params_compared"] = len(g_ours)
            except AssertionError as e:
                out["fwd_error"] = str(e)
        out["curve_ours"].append(losses[0][1])
        out["curve_native"].append(losses[1][1])
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    if "fwd_error" in out:
        raise AssertionError(out["fwd_error"])
    diffs = [abs(a - b) for a, b in zip(out["curve_ours"], out["curve_native"])]
    out["curve_max_diff"] = max(diffs)
    if not max(diffs) <= 1e-4:
        raise AssertionError(f"loss curves differ by {max(diffs):.3e}: {out}")
    if not out["curve_ours"][-1] < out["curve_ours"][0]:
        raise AssertionError(f"training did not lower the loss: {out['curve_ours']}")
    return out


def check_pipeline_stages(ps):
    """PP=2 (TP=1): only the last stage builds the loss; megatron-core calls it only there."""
    from vocab_parallel_loss import VocabParallelCrossEntropy
    from vocab_parallel_loss.megatron import VocabParallelLossConfig, VocabParallelLossGPTModel
    from vocab_parallel_loss.megatron.layer_specs import sdpa_gpt_layer_spec

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
    try:
        first = ps.get_pipeline_model_parallel_rank() == 0
        model = VocabParallelLossGPTModel(
            config=tiny_config(tp=1, pp=2), transformer_layer_spec=sdpa_gpt_layer_spec(), vocab_size=VOCAB,
            max_sequence_length=SEQ, pre_process=first, post_process=not first,
            share_embeddings_and_output_weights=False, loss_config=VocabParallelLossConfig(enabled=True))
        if first:
            assert model.vocab_parallel_loss is None, "a first pipeline stage needs no loss"
        else:
            assert isinstance(model.vocab_parallel_loss, VocabParallelCrossEntropy)
        return {"stage": "first" if first else "last"}
    finally:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=TP)


def check_fused_linear(ps):
    """--vocab-parallel-loss-fused-linear: the loss from the output layer's input and weight equals
    our loss on materialized logits, in loss and every parameter's gradient (tied and untied
    embeddings, sequence parallelism off and on); the output layer never runs; without labels the
    model returns the unfused model's logits."""

    out = {}
    tokens, pos, labels = batch(0)
    labels = labels.clone()
    labels[0, :3] = -100  # ignored tokens
    upstream = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3))
    variants = [  # name, tied, sequence_parallel, loss options
        ("tied", True, False, {}),
        ("untied", False, False, dict(label_smoothing=0.1, z_loss=1e-3)),
        ("tied_sp", True, True, dict(label_smoothing=0.1, z_loss=1e-3)),
        ("untied_sp", False, True, {}),
        # the default budget saves the logits tiles under the interpreter; 0 recomputes them
        ("untied_sp_recompute", False, True, dict(memory_budget_gib=0.0)),
        # gradient-accumulation fusion: main_grad buffers and megatron-core's own DDP hook
        ("tied_main_grad", True, False, dict(main_grad=True)),
        ("untied_sp_recompute_main_grad", False, True, dict(memory_budget_gib=0.0, main_grad=True)),
    ]
    with cpu_sequence_parallel():
        return _fused_linear_variants(variants, tokens, pos, labels, upstream, out)


@contextlib.contextmanager
def cpu_sequence_parallel():
    """Test scaffolding, this process only: megatron-core's sequence-parallel code is CUDA-only in
    two incidental ways. Its embedding forks the CUDA RNG tracker around dropout (0 here): a no-op
    fork; its linear layers allocate gather / reduce-scatter buffers on
    ``torch.cuda.current_device()``: the CPU. Both are undone on exit."""
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        yield
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    current_device = torch.cuda.current_device
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        del tracker.fork
        torch.cuda.current_device = current_device


def _fused_linear_variants(variants, tokens, pos, labels, upstream, out):
    from vocab_parallel_loss.megatron import VocabParallelLossConfig

    from megatron.core.models.gpt.gpt_model import GPTModel

    from vocab_parallel_loss.megatron import attach_vocab_parallel_loss

    for name, tied, sp, opts in variants:
        opts = dict(opts)
        main_grad = opts.pop("main_grad", False)
        cfg = VocabParallelLossConfig(enabled=True, fused_linear=True, **opts)
        if name == "tied":  # the Megatron-LM route: a plain GPTModel given our loss afterwards
            fused = attach_vocab_parallel_loss(build(None, cls=GPTModel, tied=tied, sequence_parallel=sp), cfg)
        else:
            fused = build(cfg, tied=tied, sequence_parallel=sp)
        ref = build(VocabParallelLossConfig(enabled=True, **opts), tied=tied, sequence_parallel=sp)
        for (n1, p1), (n2, p2) in zip(fused.named_parameters(), ref.named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2), f"{name}: initial weights differ at {n1}"
        assert fused.output_layer.sequence_parallel == sp and fused.share_embeddings_and_output_weights == tied
        if main_grad:  # after the weights were compared: the hooks hold the accumulators
            with_main_grads(fused)
            with_main_grads(ref)
        ran = []
        fused.output_layer.register_forward_hook(lambda *_: ran.append(1))

        loss = fused(tokens, pos, None, labels=labels)
        assert not ran, f"{name}: the fused path materialized logits (the output layer ran)"
        assert loss.shape == (BATCH, SEQ) and loss.dtype == torch.float32, (name, loss.shape, loss.dtype)
        ref_loss = ref(tokens, pos, None, labels=labels)
        out[f"{name}_loss_diff"] = close(f"{name}: per-token loss", loss, ref_loss, 1e-5, 1e-6)
        assert bool((loss[0, :3] == 0).all()), f"{name}: ignored tokens must have loss 0"
        (loss * upstream).sum().backward()
        (ref_loss * upstream).sum().backward()
        if main_grad:  # the output weight's gradient went straight into its main_grad
            weight = fused.shared_embedding_or_output_weight() if tied else fused.output_layer.weight
            assert weight.grad_added_to_main_grad and weight.grad is None, name
            g_fused, g_ref = named_main_grads(fused), named_main_grads(ref)
        else:
            g_fused, g_ref = named_grads(fused), named_grads(ref)
        n_params = len(list(fused.parameters()))
        assert g_fused.keys() == g_ref.keys() and len(g_fused) == n_params, f"{name}: missing gradients"
        worst = 0.0
        for pname in g_ref:
            scale = g_ref[pname].abs().max().item()
            worst = max(worst, close(f"{name}: grad of {pname}", g_fused[pname], g_ref[pname], 1e-6 + 1e-4 * scale))
        out[f"{name}_grad_max_diff"] = worst
        out[f"{name}_n_params"] = len(g_fused)

        # Evaluation (labels, no grad): still fused. Inference: no labels, the logits as before
        # (megatron-core's own _postprocess).
        fused.eval()
        ref.eval()
        with torch.no_grad():
            eval_loss, ref_eval_loss = fused(tokens, pos, None, labels=labels), ref(tokens, pos, None, labels=labels)
            assert not ran, f"{name}: the fused path materialized logits in evaluation"
            out[f"{name}_eval_loss_diff"] = close(f"{name}: eval loss", eval_loss, ref_eval_loss, 1e-5, 1e-6)
            logits, ref_logits = fused(tokens, pos, None), ref(tokens, pos, None)
        assert ran, f"{name}: without labels the output layer must run"
        assert logits.shape == (BATCH, SEQ, VOCAB // TP), (name, logits.shape)
        assert torch.equal(logits, ref_logits), f"{name}: inference logits differ from the unfused model's"

    return out


# ------------------------------------------------------------------------ multi-token prediction
MTP_HEADS = 2


def build_mtp(loss_config, tied, sequence_parallel, per_token=False, seed=4321):
    """A tiny GPTModel with MTP_HEADS multi-token-prediction heads (megatron-core's own MTP block)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from vocab_parallel_loss.megatron import VocabParallelLossGPTModel

    config = tiny_config(sequence_parallel=sequence_parallel)
    config.mtp_num_layers = MTP_HEADS
    config.mtp_loss_scaling_factor = 0.3
    config.calculate_per_token_loss = per_token
    spec = layer_spec(sequence_parallel)
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    if sequence_parallel:
        for layer in mtp_spec.layer_specs:
            for name in ("enorm", "hnorm", "layer_norm"):
                setattr(layer.submodules, name, SequenceParallelTorchNorm)
    torch.manual_seed(seed)
    return VocabParallelLossGPTModel(
        config=config, transformer_layer_spec=spec, mtp_block_spec=mtp_spec, vocab_size=VOCAB,
        max_sequence_length=SEQ, share_embeddings_and_output_weights=tied, loss_config=loss_config)


def check_mtp(ps):
    """--mtp-num-layers: every head's loss through this package, unfused (megatron-core calls
    compute_language_model_loss per head) and fused (no logits), equals megatron-core's own MTP
    loss: main per-token loss, each head's logged loss, every parameter's gradient (MTP block and
    output weight included), in training and evaluation."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from vocab_parallel_loss.megatron import VocabParallelLossConfig

    if "mtp_num_layers" not in {f.name for f in dataclasses.fields(tiny_config())}:
        return {"skipped": "this megatron-core has no multi-token prediction"}
    out = {}
    tokens, pos, labels = batch(0)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[1, 5:9] = 0
    upstream = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(5))
    variants = [  # name, tied, sequence_parallel, calculate_per_token_loss
        ("tied", True, False, False),
        ("untied_sp_per_token", False, True, True),
    ]

    def run(model, train):
        MTPLossLoggingHelper.tracker.clear()
        model.train(train)
        loss = model(tokens, pos, None, labels=labels, loss_mask=loss_mask)
        logged = MTPLossLoggingHelper.tracker.get("values")
        logged = logged.clone() if logged is not None else None
        if train:
            (loss * upstream).sum().backward()
        return loss.detach(), logged

    with cpu_sequence_parallel():
        for name, tied, sp, per_token in variants:
            native = build_mtp(VocabParallelLossConfig(enabled=False), tied, sp, per_token)
            ours = build_mtp(VocabParallelLossConfig(enabled=True), tied, sp, per_token)
            fused = build_mtp(VocabParallelLossConfig(enabled=True, fused_linear=True), tied, sp, per_token)
            # gradient-accumulation fusion: every head adds into the output weight's main_grad
            fused_mg = build_mtp(VocabParallelLossConfig(enabled=True, fused_linear=True), tied, sp, per_token)
            for model in (ours, fused, fused_mg):
                for (n1, p1), (n2, p2) in zip(model.named_parameters(), native.named_parameters()):
                    assert n1 == n2 and torch.equal(p1, p2), f"{name}: initial weights differ at {n1}"
            calls, ran = [], []
            inner = ours.vocab_parallel_loss.forward
            ours.vocab_parallel_loss.forward = lambda lg, t: (calls.append(1), inner(lg, t))[1]
            fused.output_layer.register_forward_hook(lambda *_: ran.append(1))
            ref_loss, ref_logged = run(native, True)
            assert ref_logged is not None and ref_logged.abs().sum() > 0, "megatron-core logged no MTP loss"
            for tag, model in (("unfused", ours), ("fused", fused)):
                loss, logged = run(model, True)
                key = f"{name}_{tag}"
                out[f"{key}_loss_diff"] = close(f"{key}: main per-token loss", loss, ref_loss, 1e-5, 1e-6)
                out[f"{key}_logged_diff"] = close(f"{key}: logged MTP losses", logged, ref_logged, 1e-5, 1e-6)
                g, g_ref = named_grads(model), named_grads(native)
                assert g.keys() == g_ref.keys() and any(k.startswith("mtp.") for k in g), f"{key}: gradients"
                worst = 0.0
                for pname in g_ref:
                    scale = g_ref[pname].abs().max().item()
                    worst = max(worst, close(f"{key}: grad of {pname}", g[pname], g_ref[pname], 1e-6 + 1e-4 * scale))
                out[f"{key}_grad_max_diff"] = worst
                out[f"{key}_n_params"] = len(g)
            with_main_grads(fused_mg)
            run(fused_mg, True)
            g_ref = named_grads(native)
            weight = fused_mg.shared_embedding_or_output_weight() if tied else fused_mg.output_layer.weight
            assert weight.grad_added_to_main_grad, f"{name}: the output weight's gradient was returned"
            for pname, p in fused_mg.named_parameters():
                scale = g_ref[pname].abs().max().item()
                close(f"{name}_main_grad: main_grad of {pname}", p.main_grad, g_ref[pname], 1e-6 + 1e-4 * scale)
            assert len(calls) == 1 + MTP_HEADS, f"{name}: our loss ran {len(calls)} times, not once per head"
            assert not ran, f"{name}: the fused path materialized logits (the output layer ran)"
            with torch.no_grad():
                ref_eval, _ = run(native, False)
                eval_loss, logged = run(fused, False)
            assert logged is None, f"{name}: nothing is logged in evaluation"
            out[f"{name}_fused_eval_loss_diff"] = close(f"{name}: fused eval loss", eval_loss, ref_eval, 1e-5, 1e-6)
            assert not ran, f"{name}: the fused path materialized logits in evaluation"
    MTPLossLoggingHelper.tracker.clear()
    return out


def check_mtp_acceptance(ps):
    """The MTP acceptance counts of the fused path (megatron-core 0.20 logs them; the fused loss
    has no logits): against the argmax of the full gathered fp64 logits, with and without
    sequence parallelism, labels matching the argmax on half the tokens."""
    import types

    from vocab_parallel_loss.megatron.mtp import _acceptance_counts

    group = ps.get_tensor_model_parallel_group()
    rank = ps.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g)
    local = weight[rank * (VOCAB // TP):(rank + 1) * (VOCAB // TP)].contiguous()
    preds = (hidden.double() @ weight.double().t()).argmax(-1)  # [s, b]
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[:, ::2] = preds.t()[:, ::2]
    mask = torch.ones(BATCH, SEQ)
    mask[0, :5] = 0
    valid = mask.t().bool()
    expected = (((preds == labels.t()) & valid).sum().item(), valid.sum().item())
    out = {}
    for sp in (False, True):
        model = types.SimpleNamespace(output_layer=types.SimpleNamespace(sequence_parallel=sp),
                                      pg_collection=types.SimpleNamespace(tp=group))
        mine = hidden.chunk(TP, dim=0)[rank] if sp else hidden
        correct, total = _acceptance_counts(model, mine, local, labels, mask)
        assert (correct.item(), total.item()) == expected, (sp, correct, total, expected)
        out[f"sp{int(sp)}"] = [correct.item(), total.item()]
    assert expected[0] >= SEQ * BATCH // 4, expected
    return out


# ------------------------------------------------------------------------------------- the guard
class FakeMegatronLMArgs:
    """Megatron-LM's parsed arguments as ``megatron.training.global_vars`` holds them (test
    scaffolding for a process with megatron-core only); undone on exit."""

    def __init__(self, args):
        import types

        self.module = types.ModuleType("megatron.training.global_vars")
        self.module._GLOBAL_ARGS = args

    def __enter__(self):
        sys.modules["megatron.training.global_vars"] = self.module
        return self

    def __exit__(self, *exc):
        sys.modules.pop("megatron.training.global_vars", None)
        from vocab_parallel_loss.megatron import guard

        guard.disarm()


def check_guard(ps):
    """The --vocab-parallel-loss guard on megatron-core's GPTModel: fires at the first forward of a
    model that does not compute this package's loss (before the forward runs when the model is
    wrapped, as Megatron wraps it; right after when called directly), or with other settings; passes
    our models; never fires without the flag or outside Megatron-LM; disarms itself."""
    import argparse

    from megatron.core.models.gpt.gpt_model import GPTModel

    from vocab_parallel_loss.megatron import (
        VocabParallelLossConfig,
        VocabParallelLossNotWiredError,
        add_vocab_parallel_loss_args,
        attach_vocab_parallel_loss,
        guard,
    )

    parser = add_vocab_parallel_loss_args(argparse.ArgumentParser())
    flags = parser.parse_args(["--vocab-parallel-loss", "--vocab-parallel-loss-z-loss", "1e-4"])
    tokens, pos, labels = batch(0)

    class Wrapper(torch.nn.Module):  # Megatron's Float16Module / DDP: forward(*args, **kwargs)
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    def first_forward(model, args, wrap=True):
        ran = []
        handle = model.decoder.register_forward_hook(lambda *_: ran.append(1))
        guard.arm()
        try:
            with FakeMegatronLMArgs(args):
                (Wrapper(model) if wrap else model)(tokens, pos, None, labels=labels)
            return None, bool(ran), guard.armed()
        except VocabParallelLossNotWiredError as e:
            return str(e), bool(ran), guard.armed()
        finally:
            handle.remove()

    out = {}
    err, ran, armed = first_forward(build(None, cls=GPTModel), flags)
    assert err and "never wired" in err and "pre_wrap_hooks" in err and not ran and not armed, (err, ran, armed)
    out["wrapped_error"] = err
    err, ran, armed = first_forward(build(None, cls=GPTModel), flags, wrap=False)
    assert err and "never wired" in err and ran and not armed, (err, ran, armed)
    expected = VocabParallelLossConfig.from_args(flags)
    err, ran, armed = first_forward(attach_vocab_parallel_loss(build(None, cls=GPTModel), expected), flags)
    assert err is None and ran and not armed, (err, ran, armed)
    err, _, _ = first_forward(attach_vocab_parallel_loss(build(None, cls=GPTModel), VocabParallelLossConfig(enabled=True)), flags)
    assert err and "command line asks for" in err, err
    out["mismatch_error"] = err
    err, _, _ = first_forward(build(VocabParallelLossConfig(enabled=False)), flags)
    assert err and "command line asks for" in err, err
    # With the flags parsed, attach (loss_config=None) takes them: the guard passes.
    with FakeMegatronLMArgs(flags):
        model = attach_vocab_parallel_loss([build(None, cls=GPTModel)])[0]
    assert model.loss_config == expected, model.loss_config
    # Without Megatron-LM's arguments: the loss with defaults; a wrapped chunk is unwrapped.
    wrapped = attach_vocab_parallel_loss(Wrapper(build(None, cls=GPTModel)))
    assert isinstance(wrapped, Wrapper) and wrapped.module.loss_config == VocabParallelLossConfig(enabled=True)
    err, ran, _ = first_forward(model, flags)
    assert err is None and ran, err
    # No flag, or no Megatron-LM arguments: no check, and the hook is gone.
    err, ran, armed = first_forward(build(None, cls=GPTModel), parser.parse_args([]))
    assert err is None and ran and not armed, (err, armed)
    err, ran, armed = first_forward(build(None, cls=GPTModel), None)
    assert err is None and ran and not armed, (err, armed)
    # A loop that never calls the model itself: after PATIENCE other module calls, a warning.
    guard.arm()
    part = torch.nn.Identity()
    with FakeMegatronLMArgs(flags), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(guard.PATIENCE):
            part(tokens)
        assert not guard.armed() and any("was not checked" in str(w.message) for w in caught), caught
    return out


CHECKS = {
    "fused_linear": check_fused_linear,
    "guard": check_guard,
    "holds_loss": check_holds_loss,
    "loss_matches_native": check_loss_matches_native,
    "model_and_curve": check_model_and_curve,
    "mtp": check_mtp,
    "mtp_acceptance": check_mtp_acceptance,
    "pipeline_stages": check_pipeline_stages,
}


def main():
    names = sys.argv[1:] or list(CHECKS)
    ps = setup()
    # every check runs (each ends on a barrier); a failure on any rank counts
    run_checks([(name, lambda name=name: CHECKS[name](ps)) for name in names], keep_going=True,
               summary="megatron checks passed")
    ps.destroy_model_parallel()
    end_worker()  # no interpreter finalization: see tests/_torchrun.py

if __name__ == "__main__":
    main()
