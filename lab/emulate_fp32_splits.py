"""CPU emulation of split-product errors for an fp32 LM head: log-prob and entropy errors against
fp64 of PyTorch fp32, bf16 two-part splits with three products ("bf16x3"), bf16 three-part splits
with six ("x6"), and fp16 two-part splits of power-of-two-scaled rows with three products ("h3";
the package's), at logits of standard deviation 0.5, 2 and 4. Products of the parts are exact in
fp64, so this measures the splits alone (no tensor-core rounding).

    python lab/emulate_fp32_splits.py
"""
import torch

N, H, V = 256, 4096, 32768


def lp_ent(z, t):
    ls = torch.log_softmax(z, -1)
    return ls.gather(1, t[:, None])[:, 0], -(ls.exp() * ls).sum(-1)


def bf16_parts(x, parts):
    out, r = [], x.clone()
    for _ in range(parts):
        p = r.to(torch.bfloat16).to(torch.float64)
        out.append(p)
        r = r - p
    return out


def fp16_parts(x32):
    _, e = torch.frexp(x32.abs().amax())
    s = torch.ldexp(torch.tensor(1.0), 15 - e)
    xs = x32 * s
    hi = xs.half()
    return hi.double(), (xs - hi.float()).half().double(), s.double()


def err(a, b):
    return f"{(a[0] - b[0]).abs().max():.2e} / {(a[1] - b[1]).abs().max():.2e}"


torch.manual_seed(0)
for scale in (0.5, 2.0, 4.0):
    h32 = torch.randn(N, H) * scale
    w32 = torch.randn(V, H) * H ** -0.5
    t = torch.randint(0, V, (N,))
    h, w = h32.double(), w32.double()
    ref = lp_ent(h @ w.T, t)
    hh, ww = bf16_parts(h, 3), bf16_parts(w, 3)
    x3 = hh[0] @ ww[0].T + hh[0] @ ww[1].T + hh[1] @ ww[0].T
    x6 = sum(hh[i] @ ww[j].T for i in range(3) for j in range(3) if i + j <= 2)
    eh, el, es = fp16_parts(h32)
    wh, wl, ws = fp16_parts(w32)
    h3 = (eh @ wh.T + eh @ wl.T + el @ wh.T) / (es * ws)
    print(f"logit std {scale}: fp32 {err(lp_ent((h32 @ w32.T).double(), t), ref)}, "
          f"bf16x3 {err(lp_ent(x3, t), ref)}, x6 {err(lp_ent(x6, t), ref)}, "
          f"h3 {err(lp_ent(h3, t), ref)}")
