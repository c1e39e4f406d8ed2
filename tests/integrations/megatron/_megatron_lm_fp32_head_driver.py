"""torchrun driver for tests/integrations/megatron/test_megatron_lm_fp32_head.py: Megatron-LM's own
``pretrain_gpt.py`` (a source snapshot, first on PYTHONPATH) with a README recipe written in and
``--bf16 --vocab-parallel-loss-fp32-head``, on CPU (gloo, TP=2).

    torchrun --nproc-per-node 2 _megatron_lm_fp32_head_driver.py SNAPSHOT SCENARIOS.json

Megatron-LM's argument parsing, config and model building run as in ``_megatron_lm_driver.py``
(its stand-in ``pretrain`` and CPU scaffolding): Megatron's ``get_model`` moves the model
(``.cuda()``) and wraps it in megatron-core's ``Float16Module``, which makes it bf16. Megatron-LM's
DDP and mixed-precision optimizer need CUDA (they sort parameters by ``torch.cuda.*Tensor``
types), so the training steps here take ``torch.optim.AdamW`` over the wrapped model's
parameters, through the script's own ``forward_step``. Recorded per scenario: the parameter dtypes
after conversion, the first step's per-token loss against fp64 cross entropy of the bf16 hidden
states entering the loss @ the gathered fp32 output weight, the losses of the steps, and the
output weight's dtype after them.
"""

from __future__ import annotations

import datetime
import json
import runpy
import sys
import tempfile
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests._torchrun import end_worker, run_checks  # noqa: E402
from tests.integrations.megatron import _megatron_lm_driver as base  # noqa: E402

STEPS = 3


def run_scenario(snapshot: Path, recipe: str, extra, workdir: Path):
    import megatron.training

    script = workdir / f"pretrain_gpt_{recipe}.py"
    if dist.get_rank() == 0:
        script.write_text(base.megatron_lm_recipes.apply((snapshot / "pretrain_gpt.py").read_text(), recipe))
    dist.barrier()
    megatron.training.pretrain = base.stand_in_pretrain
    sys.argv = ["pretrain_gpt.py", *base.FLAGS, *extra]
    with base.cpu_scaffolding():
        runpy.run_path(str(script), run_name="__main__")
    chunk, forward_step = base.STATE["model"][0], base.STATE["forward_step"]
    inner = chunk.module
    weight = inner.output_layer.weight
    out = {"megatron_core": base._version(), "wrapper": type(chunk).__name__,
           "output_weight_dtype": str(weight.dtype),
           "other_dtypes": sorted({str(p.dtype) for n, p in inner.named_parameters()
                                   if not n.startswith("output_layer.")}),
           "fused_linear": bool(getattr(inner, "_vpl_fused_linear", False))}
    initial = weight.detach().clone()
    chunk.train()
    optimizer = torch.optim.AdamW(chunk.parameters(), lr=1e-2)
    seen, losses = {}, []
    handle = inner.decoder.register_forward_hook(lambda _m, _i, o: seen.__setitem__("hidden", o.detach()))
    with base.cpu_scaffolding():
        for it in range(STEPS):
            optimizer.zero_grad(set_to_none=True)
            per_token, _ = forward_step(base.batches(), chunk)
            loss = per_token.float().mean()
            loss.backward()
            if it == 0:
                out["step0_loss_err"] = _fp64_error(per_token.detach(), seen["hidden"], weight)
                out["weight_grad_dtype"] = str(weight.grad.dtype)
            optimizer.step()
            losses.append(loss.item())
    handle.remove()
    out.update(losses=losses, weight_dtype_after=str(weight.dtype),
               weight_moved=(weight.detach() - initial).abs().max().item())
    return out


def _fp64_error(per_token, hidden, weight):
    """Max |loss - fp64 cross entropy of hidden (as given) @ the gathered weight| over the tokens."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, weight.detach().contiguous(), group=group)
    logits = (hidden.double() @ torch.cat(parts).double().t()).transpose(0, 1)  # [b, s, V]
    labels = next(base.batches())["labels"]
    ref = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                          reduction="none").view(labels.shape)
    return (per_token.double() - ref).abs().max().item()


def scenario(snapshot: Path, recipe: str, extra, workdir: Path):
    def run():
        try:
            return run_scenario(snapshot, recipe, extra, workdir)
        except SystemExit as e:  # Megatron-LM exits on what it refuses: recorded like an error
            raise RuntimeError(f"SystemExit({e.code!r})") from e
        finally:
            base.cleanup()
    return run


def main():
    snapshot, scenarios = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        name = [str(workdir)]
        dist.broadcast_object_list(name, src=0)  # every rank reads rank 0's copies
        workdir = Path(name[0])
        run_checks([(name, scenario(snapshot, recipe, extra, workdir)) for name, recipe, extra in scenarios],
                   keep_going=True, summary="Megatron-LM fp32 head scenarios passed")
        dist.barrier()
    end_worker()  # no interpreter finalization: see tests/_torchrun.py


if __name__ == "__main__":
    main()
