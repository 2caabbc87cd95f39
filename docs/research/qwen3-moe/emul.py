"""Candidate formulas for the Qwen3-MoE block (router + experts), torch only."""
import struct, torch, torch.nn.functional as F

def f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]

def fma(a, b, c):
    return (a.double() * b.double() + c.double()).float()

def fast_exp(v):
    """vLLM csrc/cpu/cpu_arch_macros.h DEFINE_FAST_EXP (AVX-512), emulated with fp64 FMAs."""
    v = v.float()
    ln_min, ln_max = f32(0xc2aeac50), f32(0x42b17218)
    lt = v < ln_min
    x = v.clamp(max=ln_max).clamp(min=ln_min)
    fx = fma(x, torch.tensor(f32(0x3fb8aa3b)), torch.tensor(0.5))
    fx = torch.floor(fx)
    p = fma(-fx, torch.tensor(f32(0x3f317218)), x)
    c = [0.999999701, 0.499991506, 0.166676521, 0.0418978221, 0.00828929059]
    c = [torch.tensor(z, dtype=torch.float32) for z in c]
    r = fma(p, c[4], c[3]); r = fma(p, r, c[2]); r = fma(p, r, c[1]); r = fma(p, r, c[0])
    r = fma(p, r, torch.tensor(1.0))
    n = (fx - 1).round().to(torch.int32)
    tp = ((n + 127) << 23).view(torch.float32)
    tp = torch.where(lt, torch.zeros_like(tp), tp)
    return r * tp * 2.0

def round_bf16(x, mode="rne"):
    if mode == "rne":
        return x.to(torch.bfloat16)
    # toward zero: drop the low 16 bits
    return (x.float().contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)

def seq_gemm(a, w):
    """fp32 sequential accumulation over k of exact bf16 products (vLLM VEC micro-gemm order). a [M,K], w [N,K]."""
    a = a.float(); w = w.float()
    c = torch.zeros(a.shape[0], w.shape[0])
    for k in range(a.shape[1]):
        c = c + a[:, k:k + 1] * w[None, :, k]
    return c

def route_hf(logits_bf16, top_k, norm=True):
    p = torch.softmax(logits_bf16, dim=-1, dtype=torch.float)
    v, i = torch.topk(p, top_k, dim=-1)
    if norm:
        v = v / v.sum(-1, keepdim=True)
    return v.to(torch.bfloat16), i

def route_vllm_cpu(logits, top_k, norm=True):
    """vllm/model_executor/layers/fused_moe/router/cpu_router.py _softmax_topk."""
    v, i = torch.topk(logits, k=top_k, dim=-1, sorted=False)
    if norm:
        w = torch.softmax(v, dim=-1)
    else:
        w = (v - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
    return w.to(torch.float32), i.to(torch.int32)

def experts_vllm_cpu(x, w13, w2, tw, ti, *, exp="fast", gemm="seq", ws="fma", rnd="rne", act_round=True):
    """x [T,H] bf16; w13 [E,2I,H]; w2 [E,H,I]; tw [T,k] fp32; ti [T,k]. cpu_fused_moe (VEC) emulation."""
    T, H = x.shape; k = ti.shape[1]; I = w2.shape[2]
    outs = torch.zeros(T, k, H)
    for t in range(T):
        pass
    mm = seq_gemm if gemm == "seq" else (lambda a, w: a.float() @ w.float().T)
    for e in range(w13.shape[0]):
        tok, pos = torch.where(ti == e)
        if tok.numel() == 0:
            continue
        h = mm(x[tok], w13[e])  # fp32
        g, u = h[:, :I], h[:, I:]
        ex = fast_exp(-g) if exp == "fast" else torch.exp(-g)
        a = u * (g * (1.0 / (1.0 + ex)))
        a = round_bf16(a, rnd) if act_round else a
        o = mm(a, w2[e])  # fp32, not rounded
        outs[tok, pos] = o
    s = outs[:, 0] * tw[:, 0:1]
    for j in range(1, k):
        s = fma(outs[:, j], tw[:, j:j + 1].expand_as(s), s) if ws == "fma" else s + outs[:, j] * tw[:, j:j + 1]
    return round_bf16(s, rnd)

def experts_hf_eager(x, w13, w2, tw, ti):
    """transformers Qwen3MoeExperts eager loop (bf16 throughout, index_add_ in bf16)."""
    I = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, pos = torch.where(ti == e)
        if tok.numel() == 0:
            continue
        g, u = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(g) * u, w2[e])
        h = h * tw[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out
