"""A/B of the fp32 head's forward from fp16 parts in memory (``LCEConfig.fwd_parts``) against
splits in registers, in one process on a GPU: ``linear_token_logprobs`` at N=8192, H=4096,
V=151936 (``N``, ``V`` from the environment), fp32 and bf16 hidden states, forward only and
forward + backward, at the default budget and 0.5 GiB; ms, peak GiB and errors against fp64
on 256 rows. ``ROUNDS`` (default 2) alternating rounds; ``OUT``: where ab_parts.json goes.

    python3 lab/ab_fp32_head_parts.py
"""
import json, os, sys, time
import torch
sys.path.insert(0, os.getcwd())
from vocab_parallel_loss import linear_token_logprobs
from vocab_parallel_loss.kernels.linear import config as C

N, H, V = int(os.environ.get("N", 8192)), 4096, int(os.environ.get("V", 151936))
g = torch.Generator().manual_seed(0)
h32 = (torch.randn(N, H, generator=g) * 0.5).cuda()
w32 = (torch.randn(V, H, generator=g) * H ** -0.5).cuda()
t = torch.randint(0, V, (N,), generator=g).cuda()
REF = 256
def ref(h):
    z = (h[:REF].double() @ w32.double().t()) / 0.7
    ls = z.log_softmax(-1)
    return ls.gather(-1, t[:REF, None])[:, 0], -(ls.exp() * ls).sum(-1)
refs = {"fp32": ref(h32), "bf16": ref(h32.bfloat16())}
def timeit(fn, reps=5):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts)//2]
rows = []
keep = {}
base_cfg = C.default_config(torch.device("cuda"))
for rnd in range(int(os.environ.get("ROUNDS", 2))):
    for hd in ("fp32", "bf16"):
        h = h32 if hd == "fp32" else h32.bfloat16()
        for parts in (True, False):
            for budget in (None, 0.5 * 2**30):
                C.OVERRIDE_CONFIG = base_cfg.replace(fwd_parts=parts)
                for bwd in (False, True):
                    hh = h.clone().requires_grad_(bwd); ww = w32.clone().requires_grad_(bwd)
                    def step():
                        with torch.set_grad_enabled(bwd):
                            out = linear_token_logprobs(hh, ww, t, temperature=0.7, return_entropy=True, memory_budget=budget)
                            if bwd:
                                torch.autograd.backward([out.log_probs, out.entropy], [torch.ones_like(out.log_probs)] * 2)
                                hh.grad = ww.grad = None
                        return out
                    torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
                    out = step(); torch.cuda.synchronize()
                    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                    el = (out.log_probs[:REF].double() - refs[hd][0]).abs().max().item()
                    ee = (out.entropy[:REF].double() - refs[hd][1]).abs().max().item()
                    keep[(hd, parts, budget, bwd)] = out.log_probs.detach().clone()
                    del out
                    ms = timeit(step, 3 if bwd else 5)
                    r = dict(rnd=rnd, hidden=hd, parts=parts, budget=budget, bwd=bwd, ms=round(ms, 2), peak_gib=round(peak, 3), err_lp=el, err_ent=ee)
                    print(json.dumps(r), flush=True); rows.append(r)
                    del hh, ww
                    torch.cuda.empty_cache()
C.OVERRIDE_CONFIG = None
for hd in ("fp32", "bf16"):
    for bwd in (False, True):
        a, b = keep[(hd, True, None, bwd)], keep[(hd, False, None, bwd)]
        print(json.dumps(dict(diff_parts_vs_registers=hd, bwd=bwd, max_abs=(a - b).abs().max().item(), differing=(a != b).float().mean().item())), flush=True)
out = os.environ.get("OUT", ".")
json.dump(rows, open(os.path.join(out, "ab_parts.json"), "w"), indent=1)
