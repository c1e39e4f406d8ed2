"""Log-probs and entropy under tensor parallelism on CUDA, every rank on the one GPU (run on the
H200: ``pytest -m gpu tests/token_logprobs``).

NCCL refuses two ranks on one GPU; gloo runs the package's collectives on CUDA tensors, so the
CPU tests' TP worker (``_distributed_worker.py``) runs there with the kernels compiled for the
GPU: over logits (``token_logprobs``) and from hidden states (``linear_token_logprobs``, each
strategy of the fused engine: every tile saved, the first tile saved and the rest recomputed a
tile at a time, everything recomputed), equal shards and unequal ones through ``vocab_range``,
sequence parallelism, scalar and per-token temperatures, both backends, against the fp64
full-vocabulary oracle. The torch.compile'd case stays on CPU: PyTorch's functional collectives
end the process on a gloo group with CUDA tensors (``tests._torchrun.compiled_collectives_run``).
"""

import pytest
import torch

from tests._torchrun import torchrun_results
from tests.token_logprobs.test_token_logprobs_distributed import WORKER, check_both_ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: Where the TP ranks run: all on the one GPU, over gloo.
SHARED_DEVICE = "cuda:0"


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [2, 4])
def test_tp_ranks_sharing_the_gpu(nproc, tmp_path):
    impls = ["triton", "torch"]
    got = torchrun_results(WORKER, nproc, ",".join(impls), results=tmp_path / "results.json",
                           timeout=900, device=SHARED_DEVICE)
    check_both_ops(got, impls, compiled=False)
