"""apply_alignment on HF model instances: identities, isolation, idempotence, autograd, errors, pins."""

import copy

import pytest
import torch
import transformers
from conftest import random_qwen
from transformers import AttentionInterface, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

import roundalign.numerics as N
from roundalign import ENGINES, VARIANTS, alignment_of, apply_alignment
from roundalign.engine import Engine
from roundalign.models.load import load_model
from roundalign.numerics import patch, regions
from roundalign.numerics import plan as plan_mod
from roundalign.numerics import regions as R
from roundalign.numerics.patch import (SLOT_ATTR, SUPPORTED_MODEL_CLASSES, default_kernels, norm_modules,
                                       recorded_alignment)
from roundalign.numerics.plan import engine_plan, plan_for

torch.set_num_threads(1)
IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_baseline_and_unaligned_are_stock(arch):
    model = random_qwen(arch)
    ref = logits(copy.deepcopy(model))
    assert torch.equal(logits(model), ref)
    apply_alignment(model, "full")
    assert not torch.equal(logits(model), ref)  # the patch really acts in bf16
    apply_alignment(model, "baseline")
    assert torch.equal(logits(model), ref)
    assert all("forward" not in m.__dict__ for m in model.modules())  # nothing left behind
    assert alignment_of(model) == ("baseline", "vllm-compiled", "eager")


@pytest.mark.parametrize("engine", ENGINES)
def test_fp32_model_every_variant_is_bitwise_noop(arch, engine):
    model = random_qwen(arch, dtype=torch.float32)
    ref = logits(copy.deepcopy(model))
    for variant in VARIANTS:
        apply_alignment(model, variant, engine)
        assert torch.equal(logits(model), ref), variant


@pytest.mark.parametrize("engine", ENGINES)
def test_each_variant_changes_only_what_the_engine_rounds_differently(arch, engine):
    model = random_qwen(arch)
    ref = logits(model)
    for variant in VARIANTS[1:]:
        apply_alignment(model, variant, engine)
        out = logits(model)
        if engine in ("vllm-eager", "vllm-cpu-eager") and variant == "swiglu":
            # vLLM's eager silu_and_mul (CUDA op; CPU: the native formula uncompiled) rounds like HF: a no-op
            assert torch.equal(out, ref)
        else:
            frac = (out != ref).float().mean().item()
            assert frac > 0.05, (variant, frac)


def test_instances_are_isolated(arch):
    a, b = random_qwen(arch), random_qwen(arch)
    stock = logits(copy.deepcopy(b))
    cls_forwards = {c: c.forward for c in (type(a.model.layers[0]), type(a.model.layers[0].self_attn),
                                           type(a.model.layers[0].mlp), type(a.model.norm))}
    apply_alignment(a, "full")
    c = apply_alignment(random_qwen(arch), "full")
    assert torch.equal(logits(b), stock)  # b untouched by a's alignment
    assert torch.equal(logits(a), logits(c))  # a aligned like any other instance
    assert all(cls.forward is fwd for cls, fwd in cls_forwards.items())  # classes never patched


def test_applying_twice_equals_once_and_variants_replace(arch):
    once = apply_alignment(random_qwen(arch), "full")
    twice = apply_alignment(apply_alignment(random_qwen(arch), "full"), "full")
    assert torch.equal(logits(once), logits(twice))
    switched = apply_alignment(apply_alignment(random_qwen(arch), "full"), "rope")
    assert torch.equal(logits(switched), logits(apply_alignment(random_qwen(arch), "rope")))
    assert alignment_of(switched) == ("rope", "vllm-compiled", "eager")


def test_patch_acts_on_decoder_modules_not_lm_head(arch):
    # TRL's GRPO computes logprobs from model.model(...) and lm_head.weight directly: the alignment
    # must live in the trunk for it to reach training logprobs.
    model = random_qwen(arch)
    with torch.no_grad():
        ref = model.model(input_ids=IDS).last_hidden_state
        apply_alignment(model, "full")
        out = model.model(input_ids=IDS).last_hidden_state
    assert "forward" not in model.lm_head.__dict__
    assert out.dtype == ref.dtype == torch.bfloat16
    assert (out != ref).float().mean().item() > 0.05


def _grads(model, ids=IDS):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("engine", ENGINES)
def test_autograd_fp32_bitwise_equal_to_stock(arch, engine):
    # In fp32 the aligned forwards compute HF's exact op sequence, so autograd must give the very same
    # gradients: this checks that no replaced forward cuts or reroutes the graph.
    model = random_qwen(arch, dtype=torch.float32)
    ref = _grads(copy.deepcopy(model))
    got = _grads(apply_alignment(model, "full", engine))
    assert ref.keys() == got.keys()
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_autograd_bf16_matches_fp64_reference(arch):
    # Reference: the same model in float64 (the "true" gradient). The aligned bf16 gradients must be
    # finite and close to it; bf16 gradients of a 2-layer model agree with fp64 to ~1e-2 relative.
    model = random_qwen(arch)
    ref = _grads(copy.deepcopy(model).to(torch.float64))
    apply_alignment(model, "full")
    got = _grads(model)
    for name, g in got.items():
        assert torch.isfinite(g).all(), name
        r = ref[name]
        rel = ((g.double() - r).norm() / r.norm()).item()
        assert rel < 0.05, (name, rel)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_same_gradients(arch, use_reentrant):
    # TRL trains with gradient_checkpointing=True by default; the fp32 residual handed between aligned
    # layers must survive the recomputation.
    model = apply_alignment(random_qwen(arch), "full")
    model.train()
    ref = _grads(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    got = _grads(model)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_errors_name_the_culprit_and_the_choices():
    model = random_qwen("qwen2")
    with pytest.raises(ValueError, match=r"unknown alignment variant 'ropee'.*baseline, rope, swiglu, norm, full"):
        apply_alignment(model, "ropee")
    with pytest.raises(ValueError, match=r"unknown engine 'sglang'.*vllm-compiled, vllm-eager"):
        apply_alignment(model, "full", engine="sglang")

    mistral = MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    with pytest.raises(TypeError, match=r"MistralForCausalLM.*Qwen2Model, Qwen2ForCausalLM"):
        apply_alignment(mistral, "full")


@pytest.mark.parametrize("head", ["ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering"])
def test_head_classes_align_their_decoder_trunk(arch, head):
    """Reward/value models (sequence classification) and the other HF heads keep the decoder under
    ``base_model``; their trunk is aligned like a causal LM's: same hidden states as the aligned causal LM's
    trunk at equal weights, and baseline restores stock outputs bitwise."""
    lm = random_qwen(arch, layers=2)
    cls = getattr(transformers, f"Qwen{arch[-1]}{head}")
    cfg = copy.deepcopy(lm.config)
    cfg.num_labels, cfg.pad_token_id = 3, 127
    model = cls(cfg).to(torch.bfloat16).eval()
    model.base_model.load_state_dict(lm.model.state_dict())
    model.base_model.rotary_emb.inv_freq = lm.model.rotary_emb.inv_freq
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(input_ids=ids, output_hidden_states=True)
        apply_alignment(model, "full")
        apply_alignment(lm, "full")
        aligned = model(input_ids=ids, output_hidden_states=True)
        lm_hidden = lm(input_ids=ids, output_hidden_states=True).hidden_states
        assert all(torch.equal(a, b) for a, b in zip(aligned.hidden_states, lm_hidden))
        assert not torch.equal(aligned.hidden_states[-1], stock.hidden_states[-1])
        apply_alignment(model, "baseline")
        again = model(input_ids=ids, output_hidden_states=True)
    assert all(torch.equal(a, b) for a, b in zip(again.hidden_states, stock.hidden_states))


def test_alignment_is_recorded_in_the_models_own_config(tmp_path):
    """HF models built from one config object share it; aligning one must not mark its sibling (which would
    save ``roundalign`` in its config.json and be aligned by load_model)."""
    cfg = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    a, b = Qwen2ForCausalLM(cfg), Qwen2ForCausalLM(cfg)
    apply_alignment(a, "full")
    assert a.config.roundalign["variant"] == "full" and a.model.config is a.config
    assert not hasattr(b.config, "roundalign") and not hasattr(cfg, "roundalign")
    b.save_pretrained(tmp_path / "b")
    assert "roundalign" not in (tmp_path / "b" / "config.json").read_text()
    apply_alignment(a, "rope")  # re-applying keeps the model's own copy
    assert a.config.roundalign["variant"] == "rope" and not hasattr(cfg, "roundalign")


# The forwards patch.py re-states are checked against each verified transformers release by numerics/compat.py
# (tests/test_library.py::test_the_installed_transformers_is_a_verified_release).


@pytest.mark.slow
def test_compiled_region_kernels_match_the_eager_reference():
    # kernels="compiled" runs each region as one Inductor kernel. RoPE and SwiGLU compile bitwise to the
    # eager formulas, the RMSNorm mean may be reduced in another order (~1e-5 of elements 1 ulp apart,
    # tests/test_inductor.py), which a 2-layer model can amplify only slightly.
    eager = apply_alignment(random_qwen("qwen3"), "full")
    compiled = apply_alignment(random_qwen("qwen3"), "full", kernels="compiled")
    ref, out = logits(eager), logits(compiled)
    assert (out == ref).float().mean().item() > 0.95
    assert (out.float() - ref.float()).abs().max().item() < 0.05
    assert alignment_of(compiled) == ("full", "vllm-compiled", "compiled")
    grads = _grads(compiled.train())
    assert all(torch.isfinite(g).all() for g in grads.values())
    with pytest.raises(ValueError, match=r"unknown region kernel mode 'triton'.*eager, compiled"):
        apply_alignment(eager, "full", kernels="triton")


def _regions_first_and_second_order(fn, inputs, g):
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    first = torch.autograd.grad(out, inputs, g.to(out.dtype), create_graph=True)
    second = torch.autograd.grad(sum((d.float() ** 2).sum() for d in first), inputs)
    return first, second


def test_region_nodes_have_the_formulas_gradients_and_second_order():
    # Each aligned region is one autograd node that saves its inputs and recomputes the fp32 formula in backward
    # (to save memory); its first and second derivatives must be bitwise those of plain autograd on the formula.
    K = R.region_kernels("eager")
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16  # (fp32 inputs bypass the node: nothing to save there, see regions._one_node)
    x = torch.randn(2, 5, 4, 16, generator=gen).to(dtype).requires_grad_()
    x32 = torch.randn(2, 5, 4, 16, generator=gen).requires_grad_()  # an unrounded fp32 sum into a bf16 norm
    r = torch.randn(2, 5, 4, 16, generator=gen).to(dtype).requires_grad_()
    w = torch.exp(0.3 * torch.randn(16, generator=gen)).to(dtype).requires_grad_()
    cos, sin = (torch.randn(2, 5, 1, 16, generator=gen).to(dtype) for _ in range(2))
    g = torch.randn(2, 5, 4, 16, generator=gen)
    cases = {
        "swiglu": (R.swiglu_fused, K.swiglu_fused, (x, r)),
        "rmsnorm": (lambda a, b: R.rmsnorm_fused(a, b, 1e-6), lambda a, b: K.rmsnorm_fused(a, b, eps=1e-6), (x, w)),
        "rmsnorm_fp32_in": (lambda a, b: R.rmsnorm_fused(a, b, 1e-6), lambda a, b: K.rmsnorm_fused(a, b, eps=1e-6),
                            (x32, w)),
        "add_rmsnorm_fp32": (lambda a, b, c: R.add_rmsnorm_fp32_sum(a, b, c, 1e-6),
                             lambda a, b, c: K.add_rmsnorm_fp32_sum(a, b, c, eps=1e-6), (x, r, w)),
        "add_rmsnorm_bf16": (lambda a, b, c: R.add_rmsnorm_bf16_sum(a, b, c, 1e-6),
                             lambda a, b, c: K.add_rmsnorm_bf16_sum(a, b, c, eps=1e-6), (x, r, w)),
    }
    for name, (plain, node, inputs) in cases.items():
        want, got = (_regions_first_and_second_order(f, inputs, g) for f in (plain, node))
        for a, b in zip(want[0] + want[1], got[0] + got[1]):
            assert torch.equal(a, b), name
        assert any(bool((d != 0).any()) for d in got[1]), name  # a real second derivative
        # plain backward takes another path for SwiGLU (an explicit, memory-lean formula): bitwise too
        out_plain, out_node = (f(*inputs) for f in (plain, node))
        out_plain, out_node = (o[0] if isinstance(o, tuple) else o for o in (out_plain, out_node))
        want1 = torch.autograd.grad(out_plain, inputs, g.to(out_plain.dtype))
        got1 = torch.autograd.grad(out_node, inputs, g.to(out_node.dtype))
        assert all(torch.equal(a, b) for a, b in zip(want1, got1)), name
    # RoPE is linear in x: its node saves only cos/sin; first derivative bitwise, second is zero
    want = torch.autograd.grad(R.rope_fused(x, cos, sin), x, g.to(dtype))[0]
    got = torch.autograd.grad(K.rope_fused(x, cos, sin), x, g.to(dtype))[0]
    assert torch.equal(want, got)


@pytest.mark.parametrize("engine", ["vllm-compiled", "vllm-cpu-eager"])
def test_attention_switch_after_alignment_takes_effect_as_on_stock(arch, engine):
    # transformers' own tests deep-copy a model and switch its attention; HF modules read config._attn_implementation
    # from their own config, so the alignment's config copy must reach every module (guards against a copy that
    # reaches only the trunk, where the switch silently does nothing). fp32: aligned == stock under every
    # implementation.
    stock = random_qwen(arch, dtype=torch.float32)
    aligned = apply_alignment(copy.deepcopy(stock), "full", engine)
    for impl in ("sdpa", "eager", "sdpa"):
        stock.set_attn_implementation(impl)
        aligned.set_attn_implementation(impl)
        assert aligned.model.layers[0].self_attn.config._attn_implementation == impl
        assert torch.equal(logits(aligned), logits(stock)), impl
    switched = copy.deepcopy(aligned)
    switched.set_attn_implementation("eager")
    assert aligned.config._attn_implementation == "sdpa"  # the copy switched, the original did not


def test_norm_sum_orders_reach_every_norm_and_are_checked(arch, tmp_path, monkeypatch):
    """``norm_sum_orders``: one ``(vec, n)`` per RMSNorm in the order the forward runs them; each norm then sums
    its squares in that order (``regions.sum_sq_in_order``, checked against Inductor in tests/test_inductor.py,
    against the real engine in tests/vllm_cpu), in both kernel modes; the orders travel with
    save_pretrained/load_model, and bad input is refused naming what is wrong."""
    model = random_qwen(arch, layers=2, hidden=128)
    norms = norm_modules(model)
    assert len(norms) == 2 * (2 if arch == "qwen2" else 4) + 1
    orders = [(4, 2) if i % 3 else (16, 1) for i in range(len(norms))]
    calls, real = [], regions.sum_sq_in_order

    def spy(xf, order):
        calls.append((xf.shape[-1], tuple(order)))
        return real(xf, order)

    monkeypatch.setattr(regions, "sum_sq_in_order", spy)
    x = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    for kernels in ("eager", "compiled"):
        calls.clear()
        apply_alignment(model, "full", "vllm-cpu-compiled", kernels=kernels, norm_sum_orders=orders)
        with torch.no_grad():
            model(input_ids=x)
        # the compiled regions trace the formula once per order and shape; eager calls it per norm
        expected = [(m.weight.shape[-1], o) for m, o in zip(norms, orders)]
        assert (calls == expected) if kernels == "eager" else set(calls) <= set(expected) and calls, (kernels, calls)
    assert [m._roundalign_sum_order for m in norms] == orders
    model.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"), dtype="bf16")
    assert [m._roundalign_sum_order for m in norm_modules(loaded)] == orders
    apply_alignment(model, "full", "vllm-cpu-compiled")  # re-applying without orders drops them
    assert not any(hasattr(m, "_roundalign_sum_order") for m in norms)

    with pytest.raises(ValueError, match=f"has 3 entries; this model runs {len(norms)} RMSNorms"):
        apply_alignment(model, "full", "vllm-cpu-compiled", norm_sum_orders=orders[:3])
    with pytest.raises(ValueError, match="engine 'vllm-cpu-compiled', not 'full' with 'vllm-compiled'"):
        apply_alignment(model, "full", "vllm-compiled", norm_sum_orders=orders)
    with pytest.raises(ValueError, match="does not tile"):
        apply_alignment(model, "full", "vllm-cpu-compiled", norm_sum_orders=[(64, 4)] * len(norms))


@pytest.mark.parametrize("engine", ["vllm-compiled", "vllm-cpu-compiled"])
def test_a_hook_that_replaces_a_layers_output_drops_the_carried_low_part(engine):
    """The carrier slot hands the fp32 low part of the residual sum to the next layer only if that layer's input IS
    the tensor the previous layer returned. A forward hook that replaces the output (here with zeros of the same
    shape and dtype) must make the next layer read exactly the replacement, not replacement + the old low part
    (guards against matching the slot by shape, which hooks that only observe cannot tell apart)."""
    model = random_qwen("qwen2", layers=3)
    apply_alignment(model, "full", engine)
    layers = model.model.layers
    seen = {}
    layers[0].register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    layers[1].input_layernorm.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0]))
    layers[2].input_layernorm.register_forward_pre_hook(lambda m, args: seen.setdefault("next", args[0]))
    logits(model)
    assert seen["x"].dtype == torch.bfloat16 and not seen["x"].any(), seen["x"]
    assert seen["next"].dtype == torch.float32  # the unhooked layer 1 still carries its low part to layer 2


# --------------------------------------------------------------------------------------------------------------
# The tests below each state one behaviour against a reference written here, with real numbers. They are fast (no slow
# marker): the first tier of ``make mutation`` runs them. ``fresh_kernels``: region kernels built anew in the test
# (tests/conftest.py's ``fresh_region_kernels``).

BF16 = torch.bfloat16
fresh_kernels = pytest.mark.usefixtures("fresh_region_kernels")


# --------------------------------------------------------------------------------------------------------------
# The ``vllm-cpu-eager`` residual row (docs/numerics.md, plan.py): the norm reads the UNROUNDED fp32 sum and rounds as
# HF does, twice; the stored stream is the sum rounded once. Pinned bitwise for a whole trunk against a forward written
# here from the model's own attention/MLP modules.


def _hf_norm_of(s32, norm):
    """HF's two roundings applied to an fp32 value: the normalized value rounded to the model dtype, then the bf16
    multiply by the weight (the native RMSNorm formula run eagerly: ``x.to(weight.dtype) * weight``)."""
    w = norm.weight
    y = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return w * y.to(w.dtype)


def _reference_cpu_eager_trunk(model, attn_kwargs, ids, stream_rounded_before_norm=False):
    """The trunk of ``model`` (variant ``norm``: attention, RoPE, MLP stock) with vLLM-CPU eager's residual rounding,
    written from numerics.md's row: each norm after an add reads the UNROUNDED fp32 sum and rounds as HF does; the
    residual stream stored (what the next add reads) is that sum rounded once. Returns (per-layer stored streams,
    final normed hidden state). ``stream_rounded_before_norm``: the alternative the row rules out (the norm reads
    the rounded sum, as stock HF)."""
    trunk = model.model
    stream = trunk.embed_tokens(ids)  # bf16, rounded (nothing to sum yet)
    s_in = stream.float()
    streams = []
    for layer, kwargs in zip(trunk.layers, attn_kwargs):
        read = s_in.to(BF16).float() if stream_rounded_before_norm else s_in
        n1 = _hf_norm_of(read, layer.input_layernorm)
        attn_out, _ = layer.self_attn(**{**kwargs, "hidden_states": n1})
        s_mid = attn_out.float() + stream.float()  # the add reads the stored (rounded) stream
        read = s_mid.to(BF16).float() if stream_rounded_before_norm else s_mid
        n2 = _hf_norm_of(read, layer.post_attention_layernorm)
        mlp_out = layer.mlp(n2)
        s_in = s_mid.to(BF16).float() + mlp_out.float()  # stored residual after attention: s_mid rounded once
        stream = s_in.to(BF16)
        streams.append(stream)
    read = s_in.to(BF16).float() if stream_rounded_before_norm else s_in
    return streams, _hf_norm_of(read, trunk.norm)


@fresh_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_cpu_eager_residual_row_is_fp32_read_with_hf_norms_bitwise(arch):
    plan = engine_plan("vllm-cpu-eager")
    assert (plan.residual, plan.norm, plan.swiglu, plan.qk_norm_rope) == ("fp32-read", "hf", "hf", "split")
    assert plan_for("vllm-cpu-eager", "norm") == type(plan)(norm="hf", residual="fp32-read")
    model = random_qwen(arch, layers=3)
    apply_alignment(model, "norm", "vllm-cpu-eager")
    ids = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(3))
    attn_kwargs, layer_out = [], []
    hooks = [layer.self_attn.register_forward_pre_hook(lambda m, a, kw: attn_kwargs.append(dict(kw)), with_kwargs=True)
             for layer in model.model.layers]
    hooks += [layer.register_forward_hook(lambda m, a, out: layer_out.append(out[0] if isinstance(out, tuple) else out))
              for layer in model.model.layers]
    with torch.no_grad():
        got = model.model(input_ids=ids, use_cache=False).last_hidden_state
    for h in hooks:
        h.remove()
    apply_alignment(model, "baseline")  # the reference calls the stock attention and MLP modules
    with torch.no_grad():
        streams, final = _reference_cpu_eager_trunk(model, attn_kwargs, ids)
        _, final_rounded = _reference_cpu_eager_trunk(model, attn_kwargs, ids, stream_rounded_before_norm=True)
    assert len(layer_out) == len(streams) == 3
    for i, (a, b) in enumerate(zip(layer_out, streams)):
        assert a.dtype == BF16 and torch.equal(a, b), f"layer {i}: stored stream differs"
    assert got.dtype == BF16 and torch.equal(got, final)
    # the reference is sensitive to the row: reading the rounded sum instead moves many elements
    assert (final_rounded != final).float().mean().item() > 0.05


# --------------------------------------------------------------------------------------------------------------
# the aligned classes and their forwards: what stock transformers does around them, and what apply_alignment refuses


@fresh_kernels
def test_numerics_package_resolves_the_patch_names_lazily():
    for name in ("SUPPORTED_MODEL_CLASSES", "alignment_of", "apply_alignment"):
        assert N.__getattr__(name) is getattr(patch, name)
    with pytest.raises(AttributeError, match=r"^module 'roundalign.numerics' has no attribute 'nope'$"):
        N.__getattr__("nope")


@fresh_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("training", [False, True])
def test_aligned_attention_calls_the_attention_interface_as_stock_does(arch, training, monkeypatch):
    """The aligned attention re-states the stock forward around the attention call: it must hand the attention
    interface exactly the keywords stock transformers does (dropout in training only, the scaling, the layer's
    sliding window, and every keyword the decoder layer passes through, with the layer's defaults when a layer is
    called on its own). The tiny models use no sliding window and no dropout, so on them a dropped ``sliding_window`` or
    an inverted ``training`` test goes unseen: here each layer gets a window of 5 and a dropout of 0.25, and a
    recording attention function compares the two models' calls."""
    calls = []

    def spy(module, q, k, v, mask, **kw):
        calls.append({key: tuple(val.shape) if torch.is_tensor(val) else val for key, val in kw.items()})
        return eager_attention_forward(module, q, k, v, mask, **kw)

    monkeypatch.setitem(AttentionInterface._global_mapping, "roundalign_spy", spy)

    def recorded(model):
        calls.clear()
        model.set_attn_implementation("roundalign_spy")
        for layer in model.model.layers:
            layer.self_attn.sliding_window, layer.self_attn.attention_dropout = 5, 0.25
        model.train(training)
        with torch.no_grad():
            # a keyword the model passes through its layers to the attention function (as flash-attention's
            # cu_seq_lens are), then one layer called on its own, with the layer's defaults
            model(input_ids=torch.arange(12).view(1, 12) % 100, roundalign_probe=7)
            h = torch.randn(1, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(3)).to(BF16)
            model.model.layers[0](h, position_embeddings=model.model.rotary_emb(h, torch.arange(5).view(1, 5)))
        return list(calls)

    want = recorded(random_qwen(arch))
    got = recorded(apply_alignment(random_qwen(arch), "full", "vllm-compiled"))
    assert len(want) == 3 and want[0]["dropout"] == (0.25 if training else 0.0) and want[0]["sliding_window"] == 5
    assert want[0]["roundalign_probe"] == 7 and want[2]["use_cache"] is False and want[2]["position_ids"] is None
    assert got == want


@fresh_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_an_aligned_model_decodes_through_transformers_kv_cache(arch):
    """The aligned decoder layer hands its attention the cache (``past_key_values``), so cached decoding
    (``generate``, or a trainer's eval loop) sees every earlier token: the cache grows by one position per step,
    and each step's logits are the full forward's at that position (bf16 matmuls over other shapes apart). The
    engine tests decode through the emulated engine's own cache, not transformers', so they do not see a layer
    that drops the cache."""
    model = apply_alignment(random_qwen(arch), "full", "vllm-compiled").eval()
    ids = (torch.arange(12).view(1, 12) * 7) % 100
    with torch.no_grad():
        full = model(input_ids=ids).logits.float()
        cache = model(input_ids=ids[:, :8], use_cache=True).past_key_values
        assert cache.get_seq_length() == 8
        for t in range(8, 12):
            step = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[0, -1].float()
            assert cache.get_seq_length() == t + 1 and cache.layers[0].keys.shape[-2] == t + 1
            assert (step - full[0, t]).abs().max() <= 0.05 * full[0, t].abs().max()


@fresh_kernels
def test_the_carrier_slot_is_empty_after_every_forward():
    """``_take_lo`` empties the trunk's carrier slot whenever it is read, so that nothing outlives one forward: after
    a forward, the slot holds no tensor (a slot left holding the last layer's output and its fp32 low part would keep
    both alive, and hand the low part to a later call that happens to pass that tensor again)."""
    model = apply_alignment(random_qwen("qwen2", layers=3), "full", "vllm-compiled")
    slots = {id(s): s for m in model.modules() if (s := getattr(m, SLOT_ATTR, None)) is not None}
    assert len(slots) == 1
    (slot,) = slots.values()
    for _ in range(2):
        with torch.no_grad():
            model(input_ids=torch.arange(10).view(1, 10))
        assert slot == {"out": None, "lo": None}


@fresh_kernels
def test_alignment_of_a_never_aligned_model_and_the_aligned_classes_names():
    """``alignment_of`` of a model never aligned is the documented default; an aligned instance's class is the
    roundalign subclass named like the stock one, from roundalign.numerics.patch (pickling finds it there), with a
    docstring saying what it is (what ``help(layer)`` shows)."""
    assert patch.alignment_of(random_qwen("qwen3")) == ("baseline", "vllm-compiled", "eager")
    aligned = apply_alignment(random_qwen("qwen3"), "full", "vllm-cpu-compiled", kernels="eager")
    assert patch.alignment_of(aligned) == ("full", "vllm-cpu-compiled", "eager")
    for module, name in ((aligned.model.layers[0], "Qwen3DecoderLayer"), (aligned.model.norm, "Qwen3RMSNorm")):
        cls = type(module)
        assert (cls.__name__, cls.__qualname__, cls.__module__) == (name, name, "roundalign.numerics.patch")
        assert getattr(patch, name) is cls
        assert cls.__doc__ == f"{name} with roundalign's aligned forward (per instance)."


@fresh_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_full_on_the_cpu_eager_engine_of_an_avx2_build_is_on_policy_and_needs_the_truncating_rope(arch, monkeypatch):
    """vLLM-CPU's eager RoPE truncates to bf16 in the _C_AVX512/_C_AVX2 builds (plan.cpu_rope_rounding: "fused-rz").
    This machine loads _C (AVX-512 BF16), so elsewhere the suite only ever takes "fused", and a patch that drops
    the truncating branch passes every other test here. With the build set to _C_AVX2, the emulated engine (which rounds
    with regions.rope_fused_rz, pinned against a truncation formula in tests/test_regions.py) and the trainer aligned
    with ``full`` give equal logprobs on every sampled token; the same trainer aligned for the _C build does not."""
    def logprobs(model, s):
        ids = torch.tensor(s.prompt_ids + s.completion_ids).unsqueeze(0)
        with torch.no_grad():
            lg = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1]
        return torch.log_softmax(lg.float(), -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]

    monkeypatch.setattr(plan_mod, "cpu_kernel_build", lambda: "_C_AVX2")
    model = random_qwen(arch)
    eng = Engine(model, engine="vllm-cpu-eager", attn="eager", gemm="same")
    assert plan_mod.engine_plan("vllm-cpu-eager").rope == "fused-rz"
    g = torch.Generator().manual_seed(0)
    samples = eng.generate([torch.randint(0, 128, (n,), generator=g).tolist() for n in (7, 7, 12)],
                           max_new_tokens=10, seed=3)
    n = sum(len(s.completion_ids) for s in samples)
    apply_alignment(model, "full", "vllm-cpu-eager")
    assert sum(int((logprobs(model, s) == s.logprobs).sum()) for s in samples) == n
    monkeypatch.setattr(plan_mod, "cpu_kernel_build", lambda: "_C")
    apply_alignment(model, "full", "vllm-cpu-eager")
    assert sum(int((logprobs(model, s) == s.logprobs).sum()) for s in samples) < 0.9 * n


@fresh_kernels
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_norm_sum_orders_take_variant_norm_and_a_wrong_count_names_the_norms_the_model_runs(arch):
    """``norm_sum_orders`` apply to the variants that align the norms, ``norm`` as well as ``full``; a list of the
    wrong length is refused with the count and the norms this architecture runs (Qwen3's q/k norms included)."""
    model = random_qwen(arch, layers=2, hidden=64)
    n = 2 * (2 if arch == "qwen2" else 4) + 1
    apply_alignment(model, "norm", "vllm-cpu-compiled", kernels="eager", norm_sum_orders=[(16, 1)] * n)
    assert [m._roundalign_sum_order for m in norm_modules(model)] == [(16, 1)] * n
    with pytest.raises(ValueError) as err:
        apply_alignment(model, "full", "vllm-cpu-compiled", kernels="eager", norm_sum_orders=[(16, 1)] * 3)
    qk = ", q, k" if arch == "qwen3" else ""
    assert str(err.value) == (f"norm_sum_orders has 3 entries; this model runs {n} RMSNorms (per layer input{qk}, "
                              "post-attention; then the final norm): was the engine's graph read for another model?")


class _Wrapper(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


@fresh_kernels
def test_a_wrapped_submodule_is_refused_naming_its_class_and_what_to_do():
    """A module apply_alignment must switch that is not a transformers Qwen module (here an MLP inside a wrapper, as
    FSDP or a user's wrapper leaves it) is refused before anything changes, naming its class and the remedy."""
    model = random_qwen("qwen2")
    model.model.layers[0].mlp = _Wrapper(model.model.layers[0].mlp)
    with pytest.raises(TypeError) as err:
        apply_alignment(model, "full", "vllm-compiled")
    assert str(err.value) == (f"cannot align a {__name__}._Wrapper instance: apply_alignment expects transformers' "
                              "modules of the families in roundalign/numerics/families.py (apply it before wrapping "
                              "the model with FSDP or other module wrappers)")
    assert not any(type(m).__module__ == "roundalign.numerics.patch" for m in model.modules())


@fresh_kernels
def test_the_recorded_alignment_is_exact_lives_in_the_models_own_config_and_baseline_removes_it():
    """apply_alignment records what it applied in the model's own copy of its config (what save_pretrained writes
    and load_model re-applies): exactly the variant, engine, kernels and any norm orders; a later apply rewrites it
    in the same config object (a user's reference to model.config stays the model's), and baseline removes it. A
    record older than the kernels choice reads as eager kernels."""
    model = random_qwen("qwen3", layers=2, hidden=64)
    shared = model.config
    apply_alignment(model, "full", "vllm-cpu-compiled", kernels="eager", norm_sum_orders=[(16, 1)] * 9)
    cfg = model.config
    assert cfg is not shared and not hasattr(shared, "roundalign")
    assert cfg.roundalign == {"variant": "full", "engine": "vllm-cpu-compiled", "kernels": "eager",
                              "norm_sum_orders": [[16, 1]] * 9}
    assert all(m.config is cfg for m in model.modules() if hasattr(m, "config"))
    apply_alignment(model, "rope", "vllm-eager")
    assert model.config is cfg and cfg.roundalign == {"variant": "rope", "engine": "vllm-eager", "kernels": "eager"}
    assert recorded_alignment(cfg)[:3] == ("rope", "vllm-eager", "eager")
    apply_alignment(model, "baseline")
    assert model.config is cfg and "roundalign" not in cfg.to_dict() and recorded_alignment(cfg) is None
    # a record written before the kernels choice existed (a4b0099) has no "kernels" key: those models ran eager
    cfg.roundalign = {"variant": "full", "engine": "vllm-eager"}
    assert recorded_alignment(cfg) == ("full", "vllm-eager", "eager")


@fresh_kernels
def test_a_model_whose_mlp_is_not_swiglu_is_refused_naming_its_activation():
    """The SwiGLU region is silu(gate) * up: a Qwen model configured with another activation is refused, naming
    it."""
    model = random_qwen("qwen2")
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError) as err:
        apply_alignment(model, "full", "vllm-compiled")
    assert str(err.value) == "roundalign aligns SwiGLU MLPs (hidden_act='silu'); this model has hidden_act='gelu'"


@fresh_kernels
def test_another_architecture_is_refused_with_the_whole_message():
    """The message a Mistral user gets, whole: the class, every supported class, the families' notes and why."""
    mistral = MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    with pytest.raises(TypeError) as err:
        apply_alignment(mistral, "full")
    assert str(err.value) == (
        f"unsupported model class MistralForCausalLM; roundalign supports {', '.join(SUPPORTED_MODEL_CLASSES)} "
        "(Qwen2.5 checkpoints load as Qwen2; Llama 3 and 3.1 checkpoints, with their rope scaling). Other "
        "architectures round in other places and need their own family record (roundalign/numerics/families.py).")
    assert "LlamaForCausalLM" in SUPPORTED_MODEL_CLASSES and "Qwen3MoeForCausalLM" in SUPPORTED_MODEL_CLASSES


@fresh_kernels
def test_the_default_kernels_are_compiled_only_for_the_cpu_compiled_engine_on_bf16():
    """Against vLLM-CPU's compiled engine the regions default to Inductor-compiled kernels (which reduce the RMSNorm
    mean as the engine's graph does: every token bitwise in tests/vllm_cpu/test_real_engine.py, where eager kernels
    left 1 of 449 apart, a test that runs only in .venv-vllm); eager everywhere else, and on fp32 models."""
    assert [default_kernels(e) for e in ("vllm-compiled", "vllm-eager", "vllm-cpu-compiled", "vllm-cpu-eager")] == [
        "eager", "eager", "compiled", "eager"]
    assert default_kernels("vllm-cpu-compiled", torch.float32) == "eager"
    assert alignment_of(apply_alignment(random_qwen("qwen2"), "full", "vllm-cpu-compiled"))[2] == "compiled"
