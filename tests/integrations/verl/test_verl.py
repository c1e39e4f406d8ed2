"""verl integration: the drop-in ``linear_cross_entropy`` (signature, reductions) and the
megatron-core ``output_processor`` (its context and gradient accumulation fusion reach
``linear_token_logprobs``); on a real megatron-core output layer under TP=2 (torchrun)."""

from pathlib import Path

import pytest
import torch

from tests._logprobs_oracle import oracle
from tests._torchrun import check_passed, torchrun_results
from vocab_parallel_loss import token_logprobs
from vocab_parallel_loss.verl import linear_cross_entropy as verl_linear_cross_entropy


def test_verl_signature_and_reductions():
    import inspect

    params = inspect.signature(verl_linear_cross_entropy).parameters
    # verl's six, positional; then this package's keyword-only options
    assert [k for k, p in params.items() if p.kind != p.KEYWORD_ONLY] == [
        "hidden", "weight", "labels", "temperature", "reduction", "dist_process_group"]
    assert [k for k, p in params.items() if p.kind == p.KEYWORD_ONLY] == [
        "fp32_precision", "batch_invariant"]
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(9, 8, generator=g), torch.randn(33, 8, generator=g)
    labels = torch.randint(0, 33, (9,), generator=g)
    lp, ent = verl_linear_cross_entropy(h, w, labels, 1.3, "none")
    want_lp, want_ent, _ = oracle(h.double() @ w.double().t(), labels, 1.3)
    torch.testing.assert_close(lp.double(), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, atol=1e-5, rtol=1e-5)
    total, _ = verl_linear_cross_entropy(h, w, labels, 1.3, "mean")
    torch.testing.assert_close(total.double(), want_lp.mean(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reduction"):
        verl_linear_cross_entropy(h, w, labels, 1.3, "max")


def test_verl_temperature_shaped_like_labels():
    # a [b, s] temperature with [b, s] labels is per token, flattened as the labels are
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(3, 5, 8, generator=g), torch.randn(33, 8, generator=g)
    labels = torch.randint(0, 33, (3, 5), generator=g)
    temp = torch.rand(3, 5, generator=g) + 0.5
    lp, ent = verl_linear_cross_entropy(h, w, labels, temp)
    want_lp, want_ent, _ = oracle(h.reshape(15, 8).double() @ w.double().t(), labels.reshape(-1),
                                 temp.reshape(-1).double())
    torch.testing.assert_close(lp.double(), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        verl_linear_cross_entropy(h, w, labels, temp.t())


def test_verl_fp32_head_with_bf16_hidden(impl):
    """An fp32 LM head: fp32 weight, bf16 hidden states as the actor gives them; fp32-class
    log-probs and entropy of the hidden states as given, on each backend."""
    g = torch.Generator().manual_seed(8)
    h, w = torch.randn(2, 9, 16, generator=g).bfloat16(), torch.randn(75, 16, generator=g) * 0.3
    labels = torch.randint(0, 75, (2, 9), generator=g)
    lp, ent = verl_linear_cross_entropy(h, w, labels, 0.9)
    want_lp, want_ent, _ = oracle(h.reshape(18, 16).double() @ w.double().t(),
                                  labels.reshape(-1), 0.9)
    assert (lp.double() - want_lp).abs().max() < 2e-5
    assert (ent.double() - want_ent).abs().max() < 2e-5


def test_verl_unusable_temperature(impl):
    # a float <= 0 raises naming it; a per-token tensor gives those tokens NaN log-prob and
    # entropy, the other tokens their values
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(9, 8, generator=g), torch.randn(33, 8, generator=g)
    labels = torch.randint(0, 33, (9,), generator=g)
    for value in (-1.0, 0.0):
        with pytest.raises(ValueError, match="temperature"):
            verl_linear_cross_entropy(h, w, labels, value)
    temp = torch.rand(9, generator=g) + 0.5
    temp[2], temp[5] = -0.7, 0.0
    lp, ent = verl_linear_cross_entropy(h, w, labels, temp)
    bad = torch.zeros(9, dtype=torch.bool)
    bad[[2, 5]] = True
    want_lp, want_ent, _ = oracle(h.double() @ w.double().t(), labels,
                                 torch.where(bad, 1.0, temp))
    assert torch.isnan(lp[bad]).all() and torch.isnan(ent[bad]).all()
    torch.testing.assert_close(lp[~bad].double(), want_lp[~bad], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[~bad].double(), want_ent[~bad], atol=1e-5, rtol=1e-5)


def test_megatron_output_processor_passes_its_context(monkeypatch):
    # the context's temperature ([b, s] -> the hidden states' [s, b]), ignore index, memory
    # budget and fp32_precision reach linear_token_logprobs; the outputs come back [b, s]
    from types import SimpleNamespace

    from vocab_parallel_loss.verl import _megatron

    seen = {}

    def fake(hidden, weight, target, bias, **kw):
        seen.update(kw, target=target)
        z = torch.zeros(target.shape)
        return SimpleNamespace(log_probs=z + 1, entropy=z + 2)

    monkeypatch.setattr(_megatron, "linear_token_logprobs", fake)
    temp = torch.rand(2, 5) + 0.5
    labels = torch.randint(0, 7, (2, 5))
    out = _megatron.output_processor(
        hidden_states=torch.zeros(5, 2, 4), output_layer=SimpleNamespace(weight=torch.zeros(7, 4),
                                                                         tp_group="tp"),
        labels=labels, context={"temperature": temp, "ignore_index": -1, "memory_budget": 123,
                                "fp32_precision": "tf32"})
    assert seen["memory_budget"] == 123 and seen["ignore_index"] == -1 and seen["tp_group"] == "tp"
    assert seen["fp32_precision"] == "tf32"
    assert torch.equal(seen["temperature"], temp.t()) and torch.equal(seen["target"], labels.t())
    assert out["log_probs"].shape == (2, 5) and torch.all(out["entropy"] == 2)


def test_megatron_output_processor_fuses_gradient_accumulation(monkeypatch):
    # with the config's gradient_accumulation_fusion and a main_grad on the weight, it asks
    # linear_token_logprobs to add the weight's gradient there
    from types import SimpleNamespace

    from vocab_parallel_loss.verl import _megatron

    seen = {}

    def fake(hidden, weight, target, bias, **kw):
        seen.update(kw)
        z = torch.zeros(target.shape)
        return SimpleNamespace(log_probs=z, entropy=z)

    monkeypatch.setattr(_megatron, "linear_token_logprobs", fake)
    weight = torch.zeros(7, 4)
    layer = SimpleNamespace(weight=weight, tp_group="tp")
    call = dict(hidden_states=torch.zeros(5, 2, 4), output_layer=layer,
                labels=torch.zeros(2, 5, dtype=torch.long))
    for fusion, has_home, want in ((True, True, True), (True, False, False),
                                   (False, True, False)):
        if has_home:
            weight.main_grad = torch.zeros(7, 4)
        elif hasattr(weight, "main_grad"):
            del weight.main_grad
        _megatron.output_processor(config=SimpleNamespace(gradient_accumulation_fusion=fusion),
                                   **call)
        assert seen["gradient_accumulation_fusion"] is want, (fusion, has_home)



@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_megatron_output_processor_on_a_real_output_layer(tmp_path):
    pytest.importorskip("megatron.core")
    results = torchrun_results(Path(__file__).with_name("_output_processor_worker.py"), 2,
                               results=tmp_path / "results.json", timeout=600)
    check_passed(results, "output_processor")
