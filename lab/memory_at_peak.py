"""The live allocations at the peak of one fp32-head step of ``linear_token_logprobs`` under a
stated 0.5 GiB budget (N=8192, H=4096, V=151936; ``HD=fp32`` for fp32 hidden states), from
PyTorch's CUDA memory history, each with the package frames that allocated it.

    python3 lab/memory_at_peak.py
"""
import os, sys, json
import torch
sys.path.insert(0, os.getcwd())
from vocab_parallel_loss import linear_token_logprobs
N, H, V = 8192, 4096, int(os.environ.get("V", 151936))
hd = os.environ.get("HD", "bf16")
g = torch.Generator().manual_seed(0)
h = (torch.randn(N, H, generator=g) * 0.5).cuda()
h = (h.bfloat16() if hd == "bf16" else h).requires_grad_()
w = (torch.randn(V, H, generator=g) * H ** -0.5).cuda().requires_grad_()
t = torch.randint(0, V, (N,), generator=g).cuda()
glp, gent = torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
def step():
    out = linear_token_logprobs(h, w, t, temperature=0.7, return_entropy=True, memory_budget=0.5 * 2**30)
    torch.autograd.backward([out.log_probs, out.entropy], [glp, gent])
step(); h.grad = w.grad = None
torch.cuda.synchronize()
torch.cuda.memory._record_memory_history(max_entries=200000)
base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
step(); torch.cuda.synchronize()
peak = torch.cuda.max_memory_allocated() - base
grads = sum(x.grad.numel() * x.grad.element_size() for x in (h, w))
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
print(f"{hd} V={V} peak-grads {(peak - grads) / 2**30:.3f} GiB, peak {peak/2**20:.0f} MiB, grads {grads/2**20:.0f} MiB")
ev = [e for tr in snap["device_traces"] for e in tr]
live, cur, best, best_set = {}, 0, -1, None
for e in ev:
    if e["action"] == "alloc":
        live[e["addr"]] = e; cur += e["size"]
    elif e["action"] in ("free_requested",):
        if e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    if cur > best:
        best, best_set = cur, dict(live)
print(f"trace peak {best/2**20:.0f} MiB above the trace start")
def where(e):
    fr = [f for f in e.get("frames", []) if "vocab_parallel_loss" in f["filename"]]
    return " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in fr[:4])
for e in sorted(best_set.values(), key=lambda e: -e["size"])[:15]:
    print(f"{e['size']/2**20:9.1f} MiB  {where(e)}")
