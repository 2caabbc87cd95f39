"""The ``vllm-compiled`` rounding style is what Inductor makes of vLLM's native formulas.

vLLM (default -O2: ``CompilationMode.VLLM_COMPILE``, Inductor, ``custom_ops="none"``) runs the
``forward_native`` Python formulas of RMSNorm, SiluAndMul and RotaryEmbedding through Inductor, which
computes fused elementwise chains in fp32 and drops the bf16 down-casts written between them. vLLM is not
installed here, so those formulas are copied below verbatim (they are a few lines each) and compiled with
``torch.compile(backend="inductor", dynamic=False)`` on CPU. Each compiled result is compared with the
roundalign ``*_fused`` region, and the same formulas run eagerly are shown to round differently (so the
comparison has teeth: without compilation they agree with HF, not with the fused regions).

Slow: five small Inductor compilations (C++ codegen + gcc), all with fixed shapes; the Inductor cache goes
to a per-session temporary directory.
"""

import time

import numpy as np
import pytest
import torch
from torch._inductor.utils import run_and_get_code
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from roundalign.bridge.inductor_code import find_output_code, norm_sum_orders, parse_output_code
from roundalign.numerics import regions
from roundalign.numerics.vllm_native import (
    vllm_cos_sin_cache,
    vllm_qwen3_qk_norm_rope,
    vllm_fused_add_rms_norm,
    vllm_rms_norm,
    vllm_rope_forward_native,
    vllm_silu_and_mul,
)

torch.set_num_threads(1)

pytestmark = pytest.mark.slow

BF16 = torch.bfloat16
EPS = 1e-6
T = 256  # tokens
HIDDEN = 896
INTER = 4864
HEAD_DIM = 128
N_HEADS, N_KV_HEADS = 8, 2
MAX_POS = 8192
THETA = 1e6
MAX_NORM_FRAC = 1e-4  # fp32 reduction-order noise allowed for the norms (bitwise elsewhere)




# ----------------------------------------------------------------------------------------------
# helpers


def bits(t):
    assert t.dtype == BF16
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def ulp_diff(a, b):
    def ordered(u):
        u = u.astype(np.int64)
        return np.where(u & 0x8000, -(u & 0x7FFF), u & 0x7FFF)

    return np.abs(ordered(bits(a)) - ordered(bits(b)))


def frac_diff(a, b):
    return float((ulp_diff(a, b) != 0).mean())


def _rand(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    x[..., :: max(1, shape[-1] // 8)] *= 20.0  # outlier channels: rows span several binades
    return x.to(BF16)


def _weight(d, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.exp(0.3 * torch.randn(d, generator=g)).to(BF16)


def _positions(seed):
    return torch.randint(0, MAX_POS, (T,), generator=torch.Generator().manual_seed(2000 + seed))


def _full_tables(cache, positions):
    """neox cos/sin (T, 1, D) in bf16, as the HF-style regions take them."""
    cos, sin = cache.index_select(0, positions).chunk(2, dim=-1)
    return torch.cat((cos, cos), -1).unsqueeze(-2), torch.cat((sin, sin), -1).unsqueeze(-2)


# (scale) of the two input sets run through each compiled function: ordinary and large-magnitude
SCALES = (1.0, 300.0)


@pytest.fixture(scope="module")
def compile_fn(tmp_path_factory):
    """torch.compile with Inductor on CPU, its cache in a temporary directory; reports compile times."""
    times = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor_cache")))
        torch._dynamo.reset()

        def compile_and_run(name, fn, *args):
            compiled = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)
            t0 = time.perf_counter()
            with torch.no_grad():
                compiled(*args)  # the first call compiles
            times[name] = time.perf_counter() - t0
            print(f"\n[inductor] compiled+ran {name} in {times[name]:.1f}s")
            return compiled

        yield compile_and_run
        torch._dynamo.reset()
    print(f"\n[inductor] total compile time {sum(times.values()):.1f}s")


def _report(name, got, fused, eager):
    d = ulp_diff(got, fused)
    f_fused, f_eager = float((d != 0).mean()), frac_diff(got, eager)
    print(f"\n{name}: compiled != fused on {f_fused:.2e} of {d.size} elements (max {d.max()} ulp); "
          f"compiled != eager native on {100 * f_eager:.1f}%")
    return d, f_fused, f_eager


# ----------------------------------------------------------------------------------------------


def test_vllm_cos_sin_cache_equals_hf_tables():
    """The bf16 cos/sin tables of both stacks are bitwise equal (both: fp32 angles, one rounding)."""
    cfg = Qwen2Config(hidden_size=N_HEADS * HEAD_DIM, num_attention_heads=N_HEADS,
                      rope_parameters={"rope_type": "default", "rope_theta": THETA}, max_position_embeddings=MAX_POS)
    pos = torch.arange(MAX_POS)[None]
    cos, sin = Qwen2RotaryEmbedding(cfg)(torch.empty(0, dtype=BF16), pos)
    cache = vllm_cos_sin_cache(HEAD_DIM, MAX_POS, THETA, BF16)
    cos_full, sin_full = _full_tables(cache, pos[0])
    assert torch.equal(cos_full[:, 0], cos[0]) and torch.equal(sin_full[:, 0], sin[0])


def test_rope_compiled_equals_fused(compile_fn):
    cache = vllm_cos_sin_cache(HEAD_DIM, MAX_POS, THETA, BF16)
    pos = _positions(0)
    fn = lambda p, q, k: vllm_rope_forward_native(p, q, k, HEAD_DIM, cache)  # noqa: E731
    q0, k0 = _rand((T, N_HEADS * HEAD_DIM), 0), _rand((T, N_KV_HEADS * HEAD_DIM), 1)
    compiled = compile_fn("rope", fn, pos, q0, k0)
    cos, sin = _full_tables(cache, pos)
    for scale in SCALES:
        q, k = _rand((T, N_HEADS * HEAD_DIM), 0, scale), _rand((T, N_KV_HEADS * HEAD_DIM), 1, scale)
        with torch.no_grad():
            cq, ck = compiled(pos, q, k)
            eq, ek = fn(pos, q, k)
        for x, c, e, h in ((q, cq, eq, N_HEADS), (k, ck, ek, N_KV_HEADS)):
            xh = x.view(T, h, HEAD_DIM)
            fused = regions.rope_fused(xh, cos, sin).reshape(x.shape)
            _, f_fused, f_eager = _report(f"rope (scale {scale}, {h} heads)", c, fused, e)
            assert torch.equal(c, fused)  # bitwise
            assert torch.equal(e, regions.rope_hf(xh, cos, sin).reshape(x.shape))  # eager native = HF
            assert f_eager > 0.05  # compilation really moved the rounding


def test_silu_and_mul_compiled_equals_fused(compile_fn):
    x0 = _rand((T, 2 * INTER), 3)
    compiled = compile_fn("silu_and_mul", vllm_silu_and_mul, x0)
    for scale in SCALES:
        x = _rand((T, 2 * INTER), 3, scale)
        with torch.no_grad():
            c, e = compiled(x), vllm_silu_and_mul(x)
        gate, up = x[..., :INTER], x[..., INTER:]
        _, _, f_eager = _report(f"silu_and_mul (scale {scale})", c, regions.swiglu_fused(gate, up), e)
        assert torch.equal(c, regions.swiglu_fused(gate, up))  # bitwise
        assert torch.equal(e, regions.swiglu_hf(gate, up))  # eager native = HF
        # large |gate| saturates silu (silu(g) = g or ~0, often exact), so fewer elements differ there
        assert f_eager > (0.05 if scale == 1.0 else 0.01)


def _assert_norm_close(d, frac):
    assert frac <= MAX_NORM_FRAC, frac
    assert d.max() <= 1, d.max()


def test_rms_norm_compiled_equals_fused(compile_fn):
    w = _weight(HIDDEN, 0)
    fn = lambda x: vllm_rms_norm(x, w, EPS)  # noqa: E731
    compiled = compile_fn("rms_norm", fn, _rand((T, HIDDEN), 4))
    for scale in SCALES:
        x = _rand((T, HIDDEN), 4, scale)
        with torch.no_grad():
            c, e = compiled(x), fn(x)
        d, frac, f_eager = _report(f"rms_norm (scale {scale})", c, regions.rmsnorm_fused(x, w, EPS), e)
        _assert_norm_close(d, frac)
        assert torch.equal(e, regions.rmsnorm_hf(x, w, EPS))  # eager native = HF
        assert f_eager > 0.05


def test_add_rms_norm_compiled_equals_fp32_sum(compile_fn):
    w = _weight(HIDDEN, 1)
    fn = lambda x, r: vllm_fused_add_rms_norm(x, r, w, EPS)  # noqa: E731
    compiled = compile_fn("add_rms_norm", fn, _rand((T, HIDDEN), 5), _rand((T, HIDDEN), 6))
    for scale in SCALES:
        x, r = _rand((T, HIDDEN), 5, scale), _rand((T, HIDDEN), 6, 4 * scale)
        with torch.no_grad():
            (c, c_res), (e, e_res) = compiled(x, r), fn(x, r)
        fused, fused_res = regions.add_rmsnorm_fp32_sum(x, r, w, EPS)
        d, frac, f_eager = _report(f"add_rms_norm (scale {scale})", c, fused, e)
        _assert_norm_close(d, frac)
        assert torch.equal(c_res, fused_res) and torch.equal(c_res, x + r)  # residual stream: HF's bf16 add
        assert torch.equal(e_res, x + r)
        # eager native reads the fp32 sum too, but rounds the normalized value before the bf16 weight multiply
        assert f_eager > 0.05
        # and it is not the bf16-sum style either: the compiled graph reads the unrounded sum
        assert frac_diff(c, regions.add_rmsnorm_bf16_sum(x, r, w, EPS)[0]) > 0.01


def test_qwen3_qk_norm_rope_compiled_is_one_rounding(compile_fn):
    """q/k norm and RoPE compiled as ONE graph: the normalized q/k stay fp32 into RoPE, one rounding after
    RoPE = ``rope_fused(rmsnorm_fused(x, keep_fp32=True))``; the split style (norm rounded, then RoPE)
    differs."""
    cache = vllm_cos_sin_cache(HEAD_DIM, MAX_POS, THETA, BF16)
    qw, kw = _weight(HEAD_DIM, 2), _weight(HEAD_DIM, 3)
    pos = _positions(1)
    fn = lambda p, q, k: vllm_qwen3_qk_norm_rope(p, q, k, qw, kw, cache, HEAD_DIM, EPS)  # noqa: E731
    compiled = compile_fn("qk_norm_rope", fn, pos, _rand((T, N_HEADS * HEAD_DIM), 7),
                          _rand((T, N_KV_HEADS * HEAD_DIM), 8))
    cos, sin = _full_tables(cache, pos)
    for scale in SCALES:
        q, k = _rand((T, N_HEADS * HEAD_DIM), 7, scale), _rand((T, N_KV_HEADS * HEAD_DIM), 8, scale)
        with torch.no_grad():
            (cq, ck), (eq, ek) = compiled(pos, q, k), fn(pos, q, k)
        for x, w, c, e, h in ((q, qw, cq, eq, N_HEADS), (k, kw, ck, ek, N_KV_HEADS)):
            xh = x.view(T, h, HEAD_DIM)
            fused = regions.rope_fused(regions.rmsnorm_fused(xh, w, EPS, keep_fp32=True), cos, sin).reshape(x.shape)
            split = regions.rope_fused(regions.rmsnorm_fused(xh, w, EPS), cos, sin).reshape(x.shape)
            hf = regions.rope_hf(regions.rmsnorm_hf(xh, w, EPS), cos, sin).reshape(x.shape)
            d, frac, f_eager = _report(f"qk_norm_rope (scale {scale}, {h} heads)", c, fused, e)
            _assert_norm_close(d, frac)
            assert torch.equal(e, hf)  # eager native = HF (norm: 2 roundings, RoPE: 3)
            assert f_eager > 0.05
            f_split = frac_diff(c, split)
            print(f"  compiled != split (norm rounded, RoPE 1 rounding) on {100 * f_split:.1f}%")
            assert f_split > 0.05


@pytest.mark.parametrize("dtype,stores_fp32", [(BF16, False), (BF16, True), (torch.float32, False)])
def test_sum_sq_in_order_is_inductors_reduction_read_from_its_code(dtype, stores_fp32):
    """``regions.sum_sq_in_order`` with the order parsed out of Inductor's own generated C++ (the way
    ``inductor_code.norm_sum_orders`` reads the engine's) equals Inductor's sum of squares bitwise, on rows whose
    torch.sum differs from it. Inductor picks the tiling from the kernel's loads and stores: 2 x 16 lanes for bf16
    input on AVX-512 (2 x 8 on AVX2), 1 vector where the loop also stores fp32 (the engine's kernels that
    materialise the residual stream)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(T, HIDDEN, generator=g) * torch.rand(T, 1, generator=g) * 30).to(dtype)
    r = torch.randn(T, HIDDEN, generator=g)

    def f(x, r):  # named like vLLM's norm kernels (the parser tells roles from the fused op names)
        s = x.float() + r if stores_fp32 else x.float()
        ss = s.pow(2).sum(-1, keepdim=True)
        out = (s * torch.rsqrt(ss / HIDDEN + EPS)).to(BF16)
        return (out, ss, s) if stores_fp32 else (out, ss)

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)  # as the engine compiles: the token count symbolic, the hidden size not
    torch._dynamo.mark_dynamic(r, 0)
    got, (code,) = run_and_get_code(torch.compile(f, backend="inductor"), x, r)
    summary = parse_output_code(code)
    (order,) = set(norm_sum_orders(summary))
    vec, n = order
    assert vec in (8, 16) and n == (2 if dtype == BF16 and not stores_fp32 else 1), order
    s = x.float() + r if stores_fp32 else x.float()
    ours = regions.sum_sq_in_order(s, order)
    assert torch.equal(ours, got[1])
    assert not torch.equal(s.pow(2).sum(-1, keepdim=True), got[1])  # torch's own order differs: the test has teeth
    other = regions.sum_sq_in_order(s, (vec, 2 if n == 1 else 1))
    assert not torch.equal(other, got[1])


def test_find_output_code_can_keep_to_vllms_own_graphs(tmp_path):
    """vLLM points the process's TORCHINDUCTOR_CACHE_DIR into its compile cache, so a probe's emulated one-graph
    engine (its attention op is roundalign's) lands beside the real engine's graph, with more kernel calls; reading
    the engine's reduction orders from it gave none (seen in a sweep). ``vllm_only`` keeps to graphs of vLLM ops."""
    def module(attention_op, calls):
        body = "\n".join(f"    cpp_fused_k_{i}(buf{i})" for i in range(calls))
        return (f"cpp_fused_k_0 = async_compile.cpp_pybinding([], r'''\n''')\n"
                f"def call(args):\n    {attention_op}(q, k, v)\n{body}\n")

    d = tmp_path / "torch_aot_compile" / "h" / "inductor_cache"
    (d / "aa").mkdir(parents=True)
    (d / "bb").mkdir()
    (d / "aa" / "real.py").write_text(module("torch.ops.vllm.unified_attention_with_output.default", 3))
    (d / "bb" / "emulated.py").write_text(module("torch.ops.roundalign.engine_attention.default", 9))
    (d / "bb" / "regions.py").write_text("def call(args):\n    cpp_fused_rmsnorm_0(buf0)\n")  # no attention
    assert sorted(p.name for p in find_output_code(tmp_path)) == ["emulated.py", "real.py"]
    assert [p.name for p in find_output_code(tmp_path, vllm_only=True)] == ["real.py"]


@pytest.mark.parametrize("rows,width", [(1, 4096), (7, 896)])
def test_region_kernels_compile_to_the_same_bits_with_dynamic_or_static_shapes(rows, width):
    """roundalign compiles its region kernels with ``dynamic=True`` (vLLM marks the token count dynamic, and one
    graph then serves every batch), while the tests above compile vLLM's formulas with fixed shapes. On the CPU,
    Inductor 2.13 rounds each region alike either way (``dynamic`` True, False or None): this pins that, and with it
    why the mutation run's ``dynamic=`` mutants of regions._compiled_kernel/_compiled_vjp are equivalent."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, width, generator=g) * 3).to(BF16)
    y = torch.randn(rows, width, generator=g).to(BF16)
    w = torch.rand(width, generator=g) + 0.5  # fp32 weight: fp32 outputs, where a reduction's rounding shows
    c = torch.rand(rows, width, generator=g).to(BF16)
    cases = [(regions.rmsnorm_fused, (x, w), {"eps": EPS}),
             (regions.add_rmsnorm_fp32_sum, (x, y, w), {"eps": EPS, "keep_fp32_sum": True}),
             (regions.add_rmsnorm_bf16_sum, (x, y, w), {"eps": EPS}),
             (regions.swiglu_fused, (x, y), {}),
             (regions.rope_fused, (x, c, c.flip(-1)), {})]
    for fn, args, kw in cases:
        outs = []
        for dynamic in (True, False, None):
            torch._dynamo.reset()
            with torch.no_grad():
                out = torch.compile(lambda *a: fn(*a, **kw), backend="inductor", dynamic=dynamic)(*args)
            outs.append(out if isinstance(out, tuple) else (out,))
        for other in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0], other)), fn.__name__
    torch._dynamo.reset()
