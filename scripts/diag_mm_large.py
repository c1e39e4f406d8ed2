"""Diagnostic (GPU): dC = dz.T @ E with K = 2^19 + 3 rows through torch.mm(out_dtype=float32),
for M = 64 / 128 / 256 rows of dz.T and two leading dimensions, against an fp64 reference."""
import torch

n, h = 2**19 + 3, 4096
g = torch.Generator(device="cuda").manual_seed(0)
e = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16()
base = torch.rand(n, 256, device="cuda", generator=g) * 0.01
buf = base.bfloat16()  # (n, 256): dz-like, positive drift so sums grow like the real dC
ref = torch.zeros(256, h, device="cuda", dtype=torch.float64)
for r in range(0, n, 32768):
    ref += buf[r:r + 32768].double().t() @ e[r:r + 32768].double()
for m in (64, 128, 256):
    for ld in (256,):
        a = buf[:, :m].t()
        out = torch.empty(m, h, device="cuda")
        torch.mm(a, e, out_dtype=torch.float32, out=out)
        d = (out.double() - ref[:m]).abs().amax(dim=1) / ref[:m].abs().amax()
        out2 = torch.mm(a, e).double()
        d2 = (out2 - ref[:m]).abs().amax(dim=1) / ref[:m].abs().amax()
        a3 = buf[:, :m].contiguous().t()
        out3 = torch.empty(m, h, device="cuda")
        torch.mm(a3, e, out_dtype=torch.float32, out=out3)
        d3 = (out3.double() - ref[:m]).abs().amax(dim=1) / ref[:m].abs().amax()
        print(f"M={m}: fp32-out worst row rel err {d.max().item():.2e} (rows > 1e-3: "
              f"{(d > 1e-3).sum().item()}), bf16-out {d2.max().item():.2e}, "
              f"fp32-out ld=M {d3.max().item():.2e} (rows > 1e-3: {(d3 > 1e-3).sum().item()})")
