"""Rows per chunk of the gradients formed in forward against the saved-columns path, for the
mean loss of ``linear_cross_entropy`` on a GPU: at each budget the strategy's own choice
("auto") and the same budget with the gradients in forward disabled ("no gif"), so the two are
compared where the budget lets the gradients in forward run in few rows. Cases: fp32 x fp32 and
bf16 hidden x fp32 (N=8192, H=4096, V=151936) and bf16 x bf16 (N=16384, H=4096, V=128256).
ms: median of 3 after one warm-up; peak: GiB above the inputs less the gradients returned.

    python3 lab/gif_rows_sweep.py        (OUT: where gif_rows.json goes)
"""
import json, os, sys
import torch
sys.path.insert(0, os.getcwd())
import vocab_parallel_loss.kernels.linear as KL
from vocab_parallel_loss import linear_cross_entropy
from vocab_parallel_loss.ops.fused_linear import strategy as S

real_rows = KL.gif_chunk_rows
CASES = [("fp32", "fp32", 8192, 151936), ("bf16", "fp32", 8192, 151936),
         ("bf16", "bf16", 16384, 128256)]
BUDGETS = [float(b) for b in os.environ.get("BUDGETS", "0.3,0.5,0.75,1,1.5,2").split(",")]
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
H = 4096


def timeit(fn, reps=3):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


rows = []
for hd, wd, n, v in CASES:
    g = torch.Generator().manual_seed(0)
    e = (torch.randn(n, H, generator=g) * 0.5).to("cuda", DT[hd]).requires_grad_()
    c = (torch.randn(v, H, generator=g) * H ** -0.5).to("cuda", DT[wd]).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).cuda()
    for budget in BUDGETS:
        for gif in (True, False):
            KL.gif_chunk_rows = real_rows if gif else (lambda *a, **k: 0)
            st = S.choose_strategy(KL, e, c, None, "mean", False, None, None, 0.0, budget * 2**30)

            def step():
                e.grad = c.grad = None
                linear_cross_entropy(e, c, t, memory_budget=budget * 2**30).backward()
            torch.cuda.synchronize(); base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats(); step(); torch.cuda.synchronize()
            grads = sum(x.grad.numel() * x.grad.element_size() for x in (e, c))
            peak = (torch.cuda.max_memory_allocated() - base - grads) / 2**30
            r = dict(hidden=hd, weight=wd, n=n, v=v, budget=budget, gif=gif,
                     strategy=st.name, size=st.size, ms=round(timeit(step), 2), extra_gib=round(peak, 3))
            print(json.dumps(r), flush=True); rows.append(r)
    KL.gif_chunk_rows = real_rows
    del e, c; torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "gif_rows.json"), "w"), indent=1)
