"""torchrun driver for tests/integrations/megatron/test_megatron_lm.py: Megatron-LM's own ``pretrain_gpt.py``
(a source snapshot, first on PYTHONPATH) with a README recipe written in, run on CPU (gloo).

    torchrun --nproc-per-node 2 _megatron_lm_driver.py SNAPSHOT SCENARIOS.json

(the outcomes go as JSON to ``$VPL_TORCHRUN_RESULTS``: ``run_checks`` in tests/_torchrun.py)

Each scenario ``[name, recipe, extra flags]`` writes the recipe into a copy of the snapshot's
``pretrain_gpt.py`` (tools/megatron_lm_recipes.py) and runs it as ``__main__`` with Megatron-LM
flags: its own argument parsing (our ``extra_args_provider`` included), its own config and model
building. Only ``pretrain`` is replaced, by a stand-in that does what ``pretrain`` does up to the
model on CPU (where the real one stops at "Megatron requires CUDA"): Megatron's initialization
without CUDA (<= 0.17: ``initialize_megatron(allow_no_cuda=True, skip_mpu_initialization=True)``,
which parses the flags), the model-parallel groups over gloo, and Megatron's own
``setup_model_and_optimizer`` (``--skip-train``: no optimizer). Then one micro-batch goes through
the script's own ``forward_step``: the guard sees that first forward; when it passes, the
per-token loss and every gradient are compared with megatron-core's own loss on the same model
(our loss switched off on it), multi-token-prediction heads' logged losses included. The upstream
gradient is a random one per token, except in the ``masked`` scenarios, where megatron-core's
schedule takes the micro-batch (its ``forward_step`` and ``backward_step``: the script's
``loss_func``, the token count, ``calculate_per_token_loss``) and the fused loss must have formed
its gradients in forward for the loss mask and used them (``masked.upstream_scale`` says so).

CPU scaffolding, this process only: ``Tensor.cuda`` and ``torch.cuda.current_device`` point at the
CPU (``get_batch`` and megatron-core allocate there), the CUDA RNG tracker's fork is a no-op
(dropout is 0), the GPU architecture Megatron-LM's argument checks ask for is Hopper's, the batch
carries an explicit causal mask (megatron-core's default one is built on CUDA), where
megatron-core asks whether a layer is TransformerEngine's inference linear, the answer is no
without TransformerEngine (0.20's MTP layer asks with ``isinstance`` on a class that is then
undefined), and under ``--sequence-parallel`` the local spec's torch norms (which refuse it: the
fused norms that allow it need Apex) are built anyway, their parameters marked
``sequence_parallel`` as megatron-core marks its fused norms'.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import runpy
import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tools"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import megatron_lm_recipes  # noqa: E402

from tests._torchrun import end_worker, run_checks  # noqa: E402

TP, SEQ, BATCH, VOCAB = 2, 16, 2, 255
FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", str(SEQ),
    "--max-position-embeddings", str(SEQ), "--micro-batch-size", str(BATCH), "--global-batch-size", str(BATCH),
    "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", str(VOCAB), "--transformer-impl", "local", "--tensor-model-parallel-size", str(TP),
    "--use-cpu-initialization", "--skip-train", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-persist-layer-norm", "--no-rope-fusion", "--seed", "1234",
]
STATE = {}


def stand_in_pretrain(*args, **kwargs):
    """``pretrain`` up to the built model, on CPU (see the module docstring)."""
    from megatron.core import parallel_state as mpu
    from megatron.training import training

    if "extra_args_provider" in kwargs:  # <= 0.17: pretrain parses the flags
        from megatron.training.initialize import initialize_megatron

        initialize_megatron(extra_args_provider=kwargs["extra_args_provider"],
                            args_defaults=kwargs.get("args_defaults", {}), allow_no_cuda=True,
                            skip_mpu_initialization=True)
        provider, model_type, forward_step, container = args[1], args[2], args[3], None
    else:  # 0.18+: pretrain(config container, datasets provider, [0.18: model provider,] model type, ...)
        bound = inspect.signature(training.pretrain).bind(*args, **kwargs).arguments
        container, model_type, forward_step = bound["cfg_container"], bound["model_type"], bound["forward_step_func"]
        provider = bound.get("model_provider")
    from megatron.training import get_args

    mpu.initialize_model_parallel(tensor_model_parallel_size=get_args().tensor_model_parallel_size)
    torch.manual_seed(1234)
    setup = training.setup_model_and_optimizer
    if next(iter(inspect.signature(setup).parameters)) == "model_provider_func":
        model, _, _ = setup(provider, model_type)
    else:
        from megatron.core.process_groups_config import ProcessGroupCollection

        model, _, _ = setup(model_type, model_provider_func=provider, cfg_container=container,
                            pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    STATE.update(model=model, forward_step=forward_step)


@contextlib.contextmanager
def cpu_scaffolding():
    from megatron.core import tensor_parallel
    from megatron.core.transformer import torch_norm
    from megatron.training import arguments

    norm_new = torch_norm.WrappedTorchNorm.__new__

    def norm_allowing_sp(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return norm_new(cls, config, hidden_size, eps, **kwargs)
        norm = (torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm)(hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = torch.Tensor.cuda, torch.cuda.current_device, getattr(arguments, "get_device_arch_version", None)
    try:
        from megatron.core.transformer import multi_token_prediction as mtp
        from transformer_engine import pytorch  # noqa: F401
    except ImportError:
        if hasattr(mtp, "is_inference_column_parallel_linear"):
            mtp.is_inference_column_parallel_linear = lambda module: False
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(norm_allowing_sp)
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: torch.device("cpu")
    if saved[2] is not None:
        arguments.get_device_arch_version = lambda: 9
    try:
        yield
    finally:
        del tracker.fork
        torch_norm.WrappedTorchNorm.__new__ = staticmethod(norm_new)
        torch.Tensor.cuda, torch.cuda.current_device = saved[:2]
        if saved[2] is not None:
            arguments.get_device_arch_version = saved[2]


def batches():
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    loss_mask = torch.ones(BATCH, SEQ)
    loss_mask[1, 3:6] = 0
    item = dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(), loss_mask=loss_mask,
                position_ids=torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ).contiguous(),
                attention_mask=torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1).expand(BATCH, 1, SEQ, SEQ).contiguous())
    while True:
        yield {k: v.clone() for k, v in item.items()}


def step(forward_step, chunk, upstream):
    """One micro-batch through the script's forward_step, then backward; (loss, grads, MTP logs)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    chunk.zero_grad(set_to_none=True)
    output, _loss_func = forward_step(batches(), chunk)
    (output.float() * upstream).sum().backward()
    logged = {k: v.detach().clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}
    grads = {n: p.grad.detach().clone() for n, p in chunk.named_parameters() if p.grad is not None}
    return output.detach(), grads, logged


def schedule_step(forward_step, chunk):
    """One micro-batch through megatron-core's own schedule steps (forward with the script's
    ``loss_func``, then backward): (per-token loss, grads, MTP logs, reported ``lm loss``, token
    count)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from megatron.core.utils import get_model_config

    MTPLossLoggingHelper.tracker.clear()
    chunk.zero_grad(set_to_none=True)
    config = get_model_config(chunk)
    outputs, store = [], []

    def recorded(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        outputs.append(output)
        return output, loss_func

    loss, num_tokens = schedules.forward_step(recorded, batches(), chunk, 1, None, store, config, 1)
    schedules.backward_step(None, loss, None, config)
    logged = {k: v.detach().clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}
    grads = {n: p.grad.detach().clone() for n, p in chunk.named_parameters() if p.grad is not None}
    report = store[0]["lm loss"].detach().clone()
    return outputs[0].detach(), grads, logged, report, num_tokens.clone()


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def run_scenario(snapshot: Path, recipe: str, extra, workdir: Path, masked: bool = False):
    from vocab_parallel_loss import VocabParallelCrossEntropy
    from vocab_parallel_loss.megatron import VocabParallelLossMixin, VocabParallelLossNotWiredError
    from vocab_parallel_loss.ops.linear_cross_entropy import masked as masked_mod

    script = workdir / f"pretrain_gpt_{recipe}.py"
    if dist.get_rank() == 0:
        script.write_text(megatron_lm_recipes.apply((snapshot / "pretrain_gpt.py").read_text(), recipe))
    dist.barrier()
    import megatron.training

    megatron.training.pretrain = stand_in_pretrain
    sys.argv = ["pretrain_gpt.py", *FLAGS, *extra]
    with cpu_scaffolding():
        script_globals = runpy.run_path(str(script), run_name="__main__")
    chunk = STATE["model"][0]
    out = {"classes": [type(m).__name__ for m in STATE["model"]], "megatron_core": _version()}
    ours = isinstance(chunk, VocabParallelLossMixin)
    out["ours"] = ours
    if ours:
        loss = chunk.vocab_parallel_loss
        out["loss_module"] = type(loss).__name__ if loss is not None else None
        assert isinstance(loss, VocabParallelCrossEntropy), out
        out["loss_tp_ranks"] = dist.get_process_group_ranks(loss.tp_group)
        out["fused_linear"] = bool(chunk._vpl_fused_linear)
    chunk.train()
    upstream = torch.rand(BATCH, SEQ, generator=torch.Generator().manual_seed(3))
    ran, taken = [], []
    chunk.output_layer.register_forward_hook(lambda *_: ran.append(1))
    scale = masked_mod.upstream_scale

    def spied(*a, **k):  # whether each fused loss's backward used the gradients formed in forward
        k_, ok = scale(*a, **k)
        taken.append(bool(ok))
        return k_, ok

    run = schedule_step if masked else (lambda f, m: step(f, m, upstream))
    with cpu_scaffolding():
        masked_mod.upstream_scale = spied
        try:
            result = run(STATE["forward_step"], chunk)
        except VocabParallelLossNotWiredError as e:
            out["guard_error"] = str(e)
            return out
        finally:
            masked_mod.upstream_scale = scale
        out["output_layer_ran"] = bool(ran)
        out["masked_taken"] = taken
        # megatron-core's own loss on the same model: ours switched off.
        processor = script_globals.get("_VPL_OUTPUT_PROCESSOR")
        if ours:
            chunk.vocab_parallel_loss, chunk._vpl_fused_linear = None, False
        elif processor is not None:
            out["processor_fused_linear"] = processor.loss_config.fused_linear
            processor._config = type(processor.loss_config)(enabled=False)
        reference = run(STATE["forward_step"], chunk)
    if masked:  # the reported lm loss and token count, through the script's own loss_func
        out["report"], out["report_ref"] = result[3].tolist(), reference[3].tolist()
        out["num_tokens"], out["num_tokens_ref"] = int(result[4]), int(reference[4])
    (loss, grads, logged), (ref_loss, ref_grads, ref_logged) = result[:3], reference[:3]
    assert loss.shape == (BATCH, SEQ) and grads.keys() == ref_grads.keys(), (loss.shape, grads.keys() ^ ref_grads.keys())
    out["loss_diff"] = max_diff(loss, ref_loss)
    out["grad_max_rel_diff"] = max(max_diff(grads[n], ref_grads[n]) / (ref_grads[n].abs().max().item() + 1e-6)
                                   for n in ref_grads)
    out["n_grads"] = len(grads)
    out["mtp_logged"] = {k: v.tolist() for k, v in logged.items()}
    out["mtp_logged_ref"] = {k: v.tolist() for k, v in ref_logged.items()}
    return out


def _version():
    import megatron.core

    return megatron.core.__version__


def cleanup():
    from megatron.core import parallel_state as mpu
    from megatron.core import rerun_state_machine
    from megatron.training import global_vars

    from vocab_parallel_loss.megatron import guard

    guard.disarm()
    global_vars.unset_global_variables()
    rerun_state_machine.destroy_rerun_state_machine()
    mpu.destroy_model_parallel()
    STATE.clear()


def scenario(snapshot: Path, recipe: str, extra, workdir: Path, masked: bool):
    def run():
        try:
            return run_scenario(snapshot, recipe, extra, workdir, masked)
        except SystemExit as e:  # Megatron-LM exits on what it refuses: recorded like an error
            raise RuntimeError(f"SystemExit({e.code!r})") from e
        finally:
            cleanup()
    return run


def main():
    snapshot, scenarios = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        if dist.get_world_size() > 1:  # every rank reads rank 0's copies
            name = [str(workdir)]
            dist.broadcast_object_list(name, src=0)
            workdir = Path(name[0]) if dist.get_rank() != 0 else workdir
        # every scenario runs (each ends on a barrier); rank 0 writes the outcomes as JSON
        run_checks([(name, scenario(snapshot, recipe, extra, workdir, "masked" in name))
                    for name, recipe, extra in scenarios], keep_going=True,
                   summary="Megatron-LM scenarios passed")
        dist.barrier()  # no rank removes the copies while another reads them
    end_worker()  # no interpreter finalization: see tests/_torchrun.py

if __name__ == "__main__":
    main()
