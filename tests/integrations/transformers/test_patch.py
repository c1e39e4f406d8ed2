"""Patched (fused linear loss, no logits) vs unpatched transformers causal LMs, on CPU."""

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import vocab_parallel_loss.transformers as vh  # noqa: E402

from ._models import FAMILIES, make_batch, make_model  # noqa: E402

LOSS_ATOL = 1e-5


def _loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_grads_close(ref, got):
    assert ref.keys() == got.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("num_items", [None, 23], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_loss_and_grads_match(model_type, num_items):
    model = make_model(model_type)
    ids, mask, labels = make_batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if num_items is not None:  # as the Trainer passes it under gradient accumulation
        inputs["num_items_in_batch"] = torch.tensor(num_items)
    ref, ref_grads = _loss_and_grads(model, **inputs)

    assert vh.patch(model, impl="torch") is model
    assert vh.is_patched(model)
    got, got_grads = _loss_and_grads(model, **inputs)

    assert got.logits is None
    assert got.loss.dtype == torch.float32
    assert abs(got.loss.item() - ref.loss.item()) <= LOSS_ATOL, (got.loss.item(), ref.loss.item())
    _assert_grads_close(ref_grads, got_grads)
    if num_items is not None:
        n_valid = int((labels[:, 1:] != -100).sum())
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        router = _router_loss(model, out)  # not divided by num_items_in_batch
        torch.testing.assert_close(got.loss - router, (out.loss - router) * n_valid / num_items)


def _router_loss(model, out):
    aux = getattr(out, "aux_loss", None)
    return 0.0 if aux is None else model.router_aux_loss_coef * aux


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_router_loss_is_added_as_the_original_adds_it(model_type):
    model = make_model(model_type)
    ids, mask, labels = make_batch()
    ref = model(input_ids=ids, attention_mask=mask, labels=labels)
    vh.patch(model, impl="torch")
    got = model(input_ids=ids, attention_mask=mask, labels=labels)
    router = _router_loss(model, got).detach()
    assert got.aux_loss is not None and router.item() > 10 * LOSS_ATOL  # the test can tell
    torch.testing.assert_close(got.aux_loss, ref.aux_loss)
    assert abs(got.loss.item() - ref.loss.item()) <= LOSS_ATOL
    # without output_router_logits neither adds it
    plain = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=False)
    assert plain.aux_loss is None
    assert abs(plain.loss.item() - (got.loss - router).item()) <= LOSS_ATOL
    # per-token losses: the router loss is left in aux_loss, not added to every token
    vh.unpatch(model)
    vh.patch(model, impl="torch", reduction="none")
    per_token = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(per_token.aux_loss, ref.aux_loss)
    valid = labels[:, 1:] != -100
    assert abs(per_token.loss.sum().item() / int(valid.sum()) - plain.loss.item()) <= LOSS_ATOL


def test_lm_head_bias():
    """Phi's LM head has a bias (zero at initialisation: made non-zero here, so it counts)."""
    model = make_model("phi")
    with torch.no_grad():
        model.lm_head.bias.copy_(torch.randn(model.lm_head.bias.shape,
                                             generator=torch.Generator().manual_seed(7)))
    ids, mask, labels = make_batch()
    ref, ref_grads = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    vh.patch(model, impl="torch")
    got, got_grads = _loss_and_grads(model, input_ids=ids, attention_mask=mask, labels=labels)
    assert abs(got.loss.item() - ref.loss.item()) <= LOSS_ATOL
    _assert_grads_close(ref_grads, got_grads)
    assert "lm_head.bias" in got_grads


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "gemma3n_text", "gemma4_text"])
def test_final_logit_softcapping(model_type):
    cap = 1.5
    model = make_model(model_type, final_logit_softcapping=cap)
    ids, mask, labels = make_batch()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # logits of a few units, where the cap bites
        ref = model(input_ids=ids, labels=labels).loss
        vh.patch(model, impl="torch")
        got = model(input_ids=ids, labels=labels).loss
        model.config.final_logit_softcapping = 1e6  # no cap, in effect (some configs refuse None)
        uncapped = model(input_ids=ids, labels=labels).loss
    assert abs(got.item() - ref.item()) <= LOSS_ATOL
    assert abs(uncapped.item() - ref.item()) > 1e-3  # the cap does change this loss


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "qwen3"])
def test_training_loop_same_losses(model_type):
    def train(patched):
        model = make_model(model_type, seed=3)
        if patched:
            vh.patch(model, impl="torch")
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for step in range(4):
            ids, mask, labels = make_batch(seed=10 + step)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ref, got = train(False), train(True)
    assert ref[0] != ref[-1]  # the model did train
    for a, b in zip(ref, got):
        assert abs(a - b) <= 1e-4, (ref, got)


def test_no_labels_unchanged_and_generate():
    model = make_model("llama").eval()
    ids, mask, _ = make_batch()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        ref_last = model(input_ids=ids, logits_to_keep=1).logits
        ref_gen = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
        vh.patch(model, impl="torch")
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, ref,
                                   rtol=0, atol=0)
        torch.testing.assert_close(model(input_ids=ids, logits_to_keep=1).logits, ref_last,
                                   rtol=0, atol=0)
        assert torch.equal(model.generate(ids[:1], max_new_tokens=3, do_sample=False), ref_gen)


def test_logits_never_materialised():
    model = make_model("qwen2")
    vh.patch(model, impl="torch")
    seen = []
    model.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.numel()))
    ids, mask, labels = make_batch()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None and seen == [0]
    assert "forward" not in model.lm_head.__dict__  # the stub is gone after the call
    out.loss.backward()


def test_positional_labels_return_dict_false_and_shift_labels():
    model = make_model("mistral")
    ids, mask, labels = make_batch()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels)
        vh.patch(model, impl="torch")
        # labels positionally: (input_ids, attention_mask, position_ids, cache/past, inputs_embeds, labels)
        tup = model(ids, None, None, None, None, labels, return_dict=False)
        assert isinstance(tup, tuple)
        assert abs(tup[0].item() - ref.loss.item()) <= LOSS_ATOL
        assert not any(torch.is_tensor(t) and t.shape[-1:] == (model.config.vocab_size,)
                       for t in tup[1:])
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        got = model(input_ids=ids, shift_labels=shifted).loss
        assert abs(got.item() - ref.loss.item()) <= LOSS_ATOL


def _assert_same_values(got, ref, path="out"):
    """Equal structure and values (tensors close; caches and other objects of the same type)."""
    if torch.is_tensor(ref):
        assert torch.is_tensor(got), path
        torch.testing.assert_close(got, ref, msg=path)
    elif isinstance(ref, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(ref), path
        for i, (g, r) in enumerate(zip(got, ref)):
            _assert_same_values(g, r, f"{path}[{i}]")
    else:
        assert type(got) is type(ref), path


@pytest.mark.parametrize("model_type,extra", [
    ("mistral", {}),
    ("mistral", {"output_hidden_states": True, "use_cache": False}),
    ("qwen2_moe", {}),  # aux_loss sits between the loss and the logits
    ("gemma3_text", {"output_attentions": True}),
], ids=["plain", "hidden_states_no_cache", "moe_aux_loss", "attentions"])
def test_return_dict_false_tuple_positions_match_transformers(model_type, extra):
    """With return_dict=False the tuple has transformers' positions: the logits' slot holds None
    and every other element is where the unpatched model puts it."""
    model = make_model(model_type)
    ids, mask, labels = make_batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False, **extra)
    with torch.no_grad():
        ref = model(**inputs)
        vh.patch(model, impl="torch")
        got = model(**inputs)
    assert isinstance(ref, tuple) and isinstance(got, tuple)
    assert len(got) == len(ref), (len(got), len(ref))
    logits_slot = [i for i, t in enumerate(ref)
                   if torch.is_tensor(t) and t.shape == (*ids.shape, model.config.vocab_size)]
    assert len(logits_slot) == 1
    assert got[logits_slot[0]] is None
    assert abs(got[0].item() - ref[0].item()) <= LOSS_ATOL
    for i in range(1, len(ref)):
        if i != logits_slot[0]:
            _assert_same_values(got[i], ref[i], f"out[{i}]")


def test_tuple_from_a_forward_that_ignores_return_dict():
    """A forward that returned its legacy tuple anyway: the stub's (empty) logits keep their
    slot, as None, after the loss."""
    from vocab_parallel_loss.transformers._patch import _with_loss

    loss, aux, cache = torch.tensor(1.5), torch.tensor(0.25), object()
    stub = torch.empty(2, 9, 0)
    assert _with_loss((stub, cache), loss, False) == (loss, None, cache)
    assert _with_loss((aux, stub, cache), loss, False) == (loss, aux, None, cache)


def test_reductions():
    model = make_model("phi3")
    ids, mask, labels = make_batch()
    with torch.no_grad():
        ref = model(input_ids=ids, labels=labels).loss
        vh.patch(model, impl="torch", reduction="sum")
        total = model(input_ids=ids, labels=labels).loss
        vh.patch(model, impl="torch", reduction="none")  # re-patching replaces the options
        per_token = model(input_ids=ids, labels=labels).loss
    n_valid = int((labels[:, 1:] != -100).sum())
    torch.testing.assert_close(total, ref * n_valid)
    assert per_token.shape == labels.shape
    assert torch.all(per_token[:, -1] == 0) and torch.all(per_token[0, :2] == 0)
    torch.testing.assert_close(per_token.sum(), total)


def test_train_only_keeps_logits_in_eval():
    model = make_model("qwen3")
    vh.patch(model, impl="torch", train_only=True)
    ids, mask, labels = make_batch()
    assert model(input_ids=ids, labels=labels).logits is None
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.logits.shape == (*ids.shape, model.config.vocab_size)


def test_patch_model_type_and_instance_scope():
    ids, mask, labels = make_batch()
    a, b = make_model("llama"), make_model("llama")
    vh.patch(a, impl="torch")
    assert a(input_ids=ids, labels=labels).logits is None
    assert b(input_ids=ids, labels=labels).logits is not None  # only that instance
    vh.unpatch(a)
    assert not vh.is_patched(a)
    assert a(input_ids=ids, labels=labels).logits is not None

    cls = transformers.LlamaForCausalLM
    original = cls.forward
    try:
        assert vh.patch("llama", impl="torch") is cls
        assert vh.is_patched("llama")
        c = make_model("llama")  # created after the patch
        ref = make_model("qwen2")(input_ids=ids, labels=labels)  # other families untouched
        assert ref.logits is not None
        for m in (b, c):
            out = m(input_ids=ids, labels=labels)
            assert out.logits is None and torch.isfinite(out.loss)
        vh.patch("llama", impl="torch")  # idempotent: does not wrap twice
        assert cls.forward.__wrapped__ is original
    finally:
        vh.unpatch("llama")
    assert cls.forward is original
    assert b(input_ids=ids, labels=labels).logits is not None


# the multimodal model type of a family whose text causal LM is patched
TEXT_ALIASES = {"gemma3_text": "gemma3", "llama4_text": "llama4", "gemma3n_text": "gemma3n",
                "gemma4_text": "gemma4", "qwen3_5_text": "qwen3_5",
                "qwen3_5_moe_text": "qwen3_5_moe"}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_patch_by_model_type(model_type):
    """Each family's config.model_type (and the multimodal type of a text model) patches its
    causal-LM class, so an existing model computes the unpatched loss without logits."""
    ids, mask, labels = make_batch()
    model = make_model(model_type)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    cls = type(model)
    for name in dict.fromkeys([model_type, TEXT_ALIASES.get(model_type, model_type)]):
        assert name in vh.SUPPORTED_MODEL_TYPES
        original = cls.forward
        try:
            assert vh.patch(name, impl="torch") is cls and vh.is_patched(name)
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=mask, labels=labels)
        finally:
            vh.unpatch(name)
        assert cls.forward is original
        assert out.logits is None
        assert abs(out.loss.item() - ref.item()) <= LOSS_ATOL, (name, out.loss.item(), ref.item())


def test_unsupported_raises():
    with pytest.raises(ValueError, match="llama.*qwen3|supported model types"):
        vh.patch("gpt2")
    config = transformers.GPT2Config(vocab_size=101, n_embd=32, n_layer=1, n_head=4, n_positions=16)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported model types"):
        vh.patch(transformers.GPT2LMHeadModel(config))
    seq_cls = transformers.LlamaForSequenceClassification(make_model("llama").config)
    with pytest.raises(ValueError, match=r"supported model types: cohere, .*\bllama\b.*\bqwen3\b"):
        vh.patch(seq_cls)
    with pytest.raises(ValueError, match="reduction"):
        vh.patch("llama", reduction="avg")


def _triton_on_cpu() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _triton_on_cpu(), reason="needs Triton with TRITON_INTERPRET=1 on CPU")
@pytest.mark.parametrize("memory_budget", [None, 0], ids=["saved-logits", "recompute"])
def test_triton_impl_under_interpreter(memory_budget):
    model = make_model("gemma2", num_hidden_layers=1)
    ids, mask, labels = make_batch(batch=1)
    ref, ref_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    vh.patch(model, impl="triton", memory_budget=memory_budget)
    got, got_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    assert got.logits is None
    assert abs(got.loss.item() - ref.loss.item()) <= LOSS_ATOL
    _assert_grads_close(ref_grads, got_grads)
    vh.unpatch(model)
    with pytest.raises(ValueError, match="memory_budget"):
        vh.patch(model, memory_budget=-1)


NEWER_FAMILIES = ["llama4_text", "deepseek_v3", "gemma3n_text", "qwen3_next", "qwen3_5_text",
                  "qwen3_5_moe_text", "gpt_oss", "glm4_moe", "olmo3"]


@pytest.mark.parametrize("model_type", ["llama", *NEWER_FAMILIES])
def test_trainer_gradient_accumulation(tmp_path, model_type):
    """The Trainer passes num_items_in_batch under gradient accumulation: same losses and
    weights as unpatched."""
    pytest.importorskip("accelerate")

    def dataset():
        rows = []
        for i in range(8):
            ids, mask, labels = make_batch(seed=100 + i, batch=1)
            labels[0, : 1 + i % 5] = -100  # a different number of tokens per sample
            rows.append(dict(input_ids=ids[0], attention_mask=mask[0], labels=labels[0]))
        return rows

    def train(patched):
        model = make_model(model_type, seed=5)
        if patched:
            vh.patch(model, impl="torch")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / f"out{int(patched)}"), per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=2, learning_rate=0.05, logging_steps=1,
            save_strategy="no", report_to=[], use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True,
            lr_scheduler_type="constant", optim="sgd",
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
        if patched:  # so the Trainer passes num_items_in_batch to the patched forward
            assert trainer.model_accepts_loss_kwargs
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}

    (ref_losses, ref_params), (losses, params) = train(False), train(True)
    assert len(losses) == 2
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-4, (ref_losses, losses)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing():
    model = make_model("qwen2")
    enable = getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)
    enable()  # renamed in transformers 5.x
    ids, mask, labels = make_batch()
    inputs = dict(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    ref, ref_grads = _loss_and_grads(model, **inputs)
    vh.patch(model, impl="torch")
    got, got_grads = _loss_and_grads(model, **inputs)
    assert abs(got.loss.item() - ref.loss.item()) <= LOSS_ATOL
    _assert_grads_close(ref_grads, got_grads)


def test_bf16_model():
    """bf16 weights: transformers upcasts bf16 logits, the fused loss accumulates in fp32."""
    model = make_model("gemma2").to(torch.bfloat16)
    ids, mask, labels = make_batch()
    ref, ref_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    vh.patch(model, impl="torch")
    got, got_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    assert got.loss.dtype == torch.float32
    assert abs(got.loss.item() - ref.loss.item()) <= 2e-2 * abs(ref.loss.item())
    for name in ref_grads:
        assert got_grads[name].dtype == torch.bfloat16
        err = (got_grads[name].float() - ref_grads[name].float()).norm()
        assert err <= 5e-2 * ref_grads[name].float().norm() + 1e-6, name


def test_all_labels_ignored_gives_zero_not_nan():
    """transformers' mean over zero tokens is nan; the fused loss returns 0 (and zero grads)."""
    model = make_model("llama")
    vh.patch(model, impl="torch")
    ids, mask, labels = make_batch()
    out = model(input_ids=ids, labels=torch.full_like(labels, -100))
    assert out.loss.item() == 0.0
    out.loss.backward()


def test_wrapped_models_are_patched_through():
    """A wrapper with get_base_model() (PEFT) is patched through its base model; an
    instance-level forward already on the model (e.g. an accelerate hook) is kept and called."""
    model = make_model("llama")
    ids, mask, labels = make_batch()
    ref = model(input_ids=ids, labels=labels).loss.item()

    calls = []
    class_forward = type(model).forward

    def hooked_forward(*args, **kwargs):  # what accelerate's add_hook_to_module installs
        calls.append(kwargs.get("labels") is None)
        return class_forward(model, *args, **kwargs)

    model.forward = hooked_forward

    class Wrapper(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base

        def get_base_model(self):
            return self.base

        def forward(self, **kwargs):
            return self.base(**kwargs)

    wrapper = Wrapper(model)
    assert vh.patch(wrapper, impl="torch") is wrapper
    assert vh.is_patched(model) and vh.is_patched(wrapper)
    out = wrapper(input_ids=ids, labels=labels)
    assert out.logits is None and abs(out.loss.item() - ref) <= LOSS_ATOL
    assert calls == [True]  # the hooked forward ran, with labels=None
    vh.unpatch(wrapper)
    assert model.forward is hooked_forward


@pytest.mark.parametrize("fp32_precision", ["fp32", "tf32"])
def test_fp32_lm_head_in_a_bf16_model(fp32_precision):
    """An fp32 lm_head in a bf16 model (an fp32 LM head, as RL trainers keep it): the patched
    loss equals the unpatched model's with the head's input cast to fp32 (the frameworks' way),
    without that cast; the head's gradient stays fp32."""
    model = make_model("llama").to(torch.bfloat16)
    model.lm_head.float()
    ids, mask, labels = make_batch()
    hook = model.lm_head.register_forward_pre_hook(lambda mod, args: (args[0].float(),))
    ref, ref_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    hook.remove()
    vh.patch(model, impl="torch", fp32_precision=fp32_precision)
    got, got_grads = _loss_and_grads(model, input_ids=ids, labels=labels)
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-5 * abs(ref.loss.item())
    head = [n for n in ref_grads if n.startswith("lm_head")]
    assert head
    for name in ref_grads:
        assert got_grads[name].dtype == ref_grads[name].dtype, name
        err = (got_grads[name].float() - ref_grads[name].float()).norm()
        tol = 1e-4 if name in head else 5e-2
        assert err <= tol * ref_grads[name].float().norm() + 1e-6, name
    with pytest.raises(ValueError, match="fp32_precision"):
        vh.patch(make_model("llama"), fp32_precision="fast")
