"""Score the engine's prompt tokens with transformers under several MoE/dense variants; report bitwise & k3."""
import sys, json, types, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
sys.path.insert(0, "/tmp/moe")
from emul import route_vllm_cpu, experts_vllm_cpu, fast_exp, fma
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

import os; MODEL = os.environ.get("MOE_MODEL", "/tmp/moe/qwen3moe")
eng_mode = sys.argv[1]  # eager | compiled
eng = json.load(open(os.environ.get("ENG_JSON", f"/tmp/moe/vllm_{eng_mode}.json")))

# --- MoE block emulating vLLM-CPU (router in cpu_router.py, experts = _C.cpu_fused_moe 'vec') ---
def moe_forward_vllm(self, hidden_states, compiled=None):
    compiled = self._ra_compiled if compiled is None else compiled
    B, S, H = hidden_states.shape
    x = hidden_states.reshape(-1, H)
    logits = F.linear(x, self.gate.weight)  # bf16 (GateLinear tier 5 on CPU: F.linear, out_dtype None)
    if compiled:  # Inductor: softmax of the 2 bf16 top-k logits in fp32, the bf16 cast is dead code
        v, i = torch.topk(logits, k=self.gate.top_k, dim=-1, sorted=False)
        v = v.float(); e = torch.exp(v - v.max(-1, keepdim=True).values)
        s = e[:, 0:1]
        for j in range(1, e.shape[1]):
            s = s + e[:, j:j + 1]
        tw, ti = e / s, i
    else:
        tw, ti = route_vllm_cpu(logits, self.gate.top_k, self.gate.norm_topk_prob)
    ex = self.experts
    out = experts_vllm_cpu(x, ex.gate_up_proj, ex.down_proj, tw, ti.long(), exp="fast", gemm="torch", ws="fma", rnd="rne")
    return out.reshape(B, S, H)

def moe_forward_stock_fp32sum(self, hidden_states):
    """H-a: HF router but fp32 router weights and fp32 expert-weighted sum, one bf16 rounding (HF experts otherwise)."""
    B, S, H = hidden_states.shape
    x = hidden_states.reshape(-1, H)
    logits = F.linear(x, self.gate.weight)
    p = torch.softmax(logits, dim=-1, dtype=torch.float)
    v, i = torch.topk(p, self.gate.top_k, dim=-1)
    v = v / v.sum(-1, keepdim=True)
    ex = self.experts; I = ex.down_proj.shape[2]
    acc = torch.zeros(x.shape[0], H)
    for e in range(ex.gate_up_proj.shape[0]):
        tok, pos = torch.where(i == e)
        if tok.numel() == 0: continue
        g, u = F.linear(x[tok], ex.gate_up_proj[e]).chunk(2, -1)
        h = F.linear(F.silu(g) * u, ex.down_proj[e])  # bf16 as HF
        acc.index_add_(0, tok, h.float() * v[tok, pos, None])
    return acc.to(x.dtype).reshape(B, S, H)

def load(attn):
    m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16, attn_implementation=attn)
    return m.eval()

def set_moe(model, fn, compiled=False):
    for layer in model.model.layers:
        layer.mlp._ra_compiled = compiled
        layer.mlp.forward = types.MethodType(fn, layer.mlp)

def align(model, engine):
    from roundalign.numerics import patch, families
    fam = families.FAMILIES["qwen3"]
    orig = patch.family_of_class
    patch.family_of_class = lambda n: fam if n.startswith("Qwen3Moe") else orig(n)
    if qm.Qwen3MoeRMSNorm not in patch._ALIGNED:
        for suffix, mixin in (("RMSNorm", patch._AlignedRMSNorm), ("DecoderLayer", patch._AlignedDecoderLayer),
                              ("Attention", patch._AlignedAttention), ("RotaryEmbedding", patch._AlignedRotaryEmbedding)):
            stock = getattr(qm, "Qwen3Moe" + suffix)
            cls = type("Qwen3Moe" + suffix, (mixin, stock), {})
            patch._ALIGNED[stock], patch._STOCK[cls] = cls, stock
        # the MoE block: no SwiGLU alignment of its own here (its forward is set separately)
        blk = type("Qwen3MoeSparseMoeBlockRA", (qm.Qwen3MoeSparseMoeBlock,), {})
        patch._ALIGNED[qm.Qwen3MoeSparseMoeBlock], patch._STOCK[blk] = blk, qm.Qwen3MoeSparseMoeBlock
    patch.apply_alignment(model, "full", engine=engine, kernels="eager" if engine.endswith("eager") else None)
    return model

@torch.no_grad()
def score(model):
    res = []
    for p in eng["prompts"]:
        ids = torch.tensor([p["ids"]])
        logits = model(ids).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        res.append(lp)
    return res

def compare(name, lps):
    d_all, eq, n = [], 0, 0
    for p, lp in zip(eng["prompts"], lps):
        e = torch.tensor(p["logprobs"][1:], dtype=torch.float32)
        d = lp.float() - e
        eq += int((lp.float() == e).sum()); n += e.numel(); d_all.append(d.double())
    d = torch.cat(d_all)
    k3 = (torch.exp(d) - 1 - d).mean().item()
    print(f"{eng_mode:8s} | {name:55s} | bitwise {eq}/{n} = {eq/n:.3f} | mean k3 {k3:.3e} | max|d| {d.abs().max().item():.2e}", flush=True)

import roundalign.bridge.vllm_cpu_attention as vc
vc.register()
engine = "vllm-cpu-eager" if eng_mode == "eager" else "vllm-cpu-compiled"
compiled = eng_mode == "compiled"
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["stock", "stock_vattn", "moe_only", "fp32sum_vattn", "align", "align_moe"]
for v in variants:
    try:
        if v == "stock":
            m = load("eager"); compare("stock HF (eager attn, grouped_mm experts)", score(m))
        elif v == "stock_eagerexp":
            m = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager").eval()
            compare("stock HF (eager attn, eager experts)", score(m))
        elif v == "stock_vattn":
            m = load("vllm_cpu"); compare("stock HF + vllm_cpu attention", score(m))
        elif v == "moe_only":
            m = load("vllm_cpu"); set_moe(m, moe_forward_vllm, compiled)
            compare("vllm_cpu attn + MoE=vLLM-CPU emulation (dense stock)", score(m))
        elif v == "fp32sum_vattn":
            m = load("vllm_cpu"); set_moe(m, moe_forward_stock_fp32sum)
            compare("vllm_cpu attn + MoE=HF w/ fp32 router wts+fp32 sum", score(m))
        elif v == "align":
            m = align(load("vllm_cpu"), engine)
            compare(f"vllm_cpu attn + apply_alignment(full,{engine}), stock MoE", score(m))
        elif v == "align_fp32sum":
            m = align(load("vllm_cpu"), engine); set_moe(m, moe_forward_stock_fp32sum)
            compare(f"aligned dense + MoE=HF w/ fp32 router wts+fp32 sum", score(m))
        elif v == "align_moe":
            m = align(load("vllm_cpu"), engine); set_moe(m, moe_forward_vllm, compiled)
            compare(f"aligned dense + MoE=vLLM-CPU emulation", score(m))
        elif v == "align_moe_eagerrouter":
            m = align(load("vllm_cpu"), engine); set_moe(m, moe_forward_vllm, not compiled)
            compare(f"aligned dense + MoE emul, OTHER mode's router wts", score(m))
    except Exception as ex:
        import traceback; traceback.print_exc()
        print(f"{eng_mode:8s} | {v}: FAILED {type(ex).__name__}: {ex}")
