"""Direct tests for mutants that the rest of the suite killed only indirectly, or not at all (issue 35, item 6).

Each test states one behaviour against a reference written here, independently of the code under test, with real
numbers. Kept fast (no slow marker): ``make mutation`` runs this file among the fast tests of numerics/, metrics.py
and training/checkpoints.py.

- RoPE with cos/sin tables whose two halves DIFFER. transformers' and vLLM's neox tables repeat one half-table twice,
  so a swap of the sin (or cos) halves in ``rope_fused`` is invisible with them; it was caught only by the
  hand-written backward's check. Here the fused, round-toward-zero, HF-style and backward RoPE are pinned bitwise
  against the rotate_half formula ``x*cos + rotate_half(x)*sin`` in float64 with the roundings of
  shared/design/numerics.md's RoPE row (engine: fp32 inside, one rounding; HF: each product, then the sum).
- The ``vllm-cpu-eager`` residual row (numerics.md, plan.py: the norm reads the UNROUNDED fp32 sum, rounds as HF
  does, twice; the stored stream is the sum rounded once), pinned bitwise for a whole trunk against a forward written
  here from the model's own attention/MLP modules; before, only "changes more than 5% of logits" held it.
- Region nodes whose inputs do not all need a gradient (a frozen norm weight or SwiGLU input, one RoPE table that
  needs one), the eager RoPE node asked for fp32, and fp32 inputs that also feed the residual stream: gradients
  bitwise those of plain autograd on formulas written here. ``fault_point``'s spec parsing observed in-process.
"""

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import random_qwen

from roundalign import apply_alignment
from roundalign.numerics import regions
from roundalign.numerics.plan import engine_plan, plan_for

torch.set_num_threads(1)
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


@pytest.fixture(autouse=True)
def fresh_region_kernels(monkeypatch):
    """Region kernels built anew in each test: ``region_kernels`` caches them per process, and a kernel built before
    a test (by another test, or before mutmut forked its worker) would hide what building it does."""
    monkeypatch.setattr(regions, "_KERNEL_CACHE", {})


# ---------------------------------------------------------------------------------------------------------------
# RoPE with distinct halves


def _rand_bf16(shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=F64) * scale).to(BF16)


def _distinct_tables(b, t, d, seed):
    """bf16 cos/sin (b, 1, t, d) from angles drawn independently for EVERY column: the halves differ (a real neox
    table repeats one half; these are not tables of any model, only inputs on which a swap of halves shows)."""
    g = torch.Generator().manual_seed(1000 + seed)
    ang = torch.rand((b, 1, t, d), generator=g, dtype=F64) * 2 * torch.pi
    cos, sin = ang.cos().to(BF16), ang.sin().to(BF16)
    h = d // 2
    assert not torch.equal(cos[..., :h], cos[..., h:]) and not torch.equal(sin[..., :h], sin[..., h:])
    return cos, sin


def _rotate_half64(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _ref_rope_fp32(x, cos, sin):
    """x*cos + rotate_half(x)*sin as one fp32 kernel computes it: each product rounded to fp32 (exact for bf16 x:
    8-bit times 8-bit significands), the sum rounded to fp32. The float64 sum of two fp32 values rounded to fp32 is
    the fp32 sum (53 >= 2*24 + 2), so float64 then ``.to(float32)`` is that fp32 value."""
    p1 = (x.to(F64) * cos.to(F64)).to(F32).to(F64)
    p2 = (_rotate_half64(x.to(F64)) * sin.to(F64)).to(F32).to(F64)
    return (p1 + p2).to(F32)


def _truncate_to_bf16(x32):
    bits = x32.contiguous().numpy().view(np.uint32) & np.uint32(0xFFFF0000)
    return torch.from_numpy(bits.view(np.float32).copy()).to(BF16)  # the truncated pattern is a bf16 value: exact


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", [(2, 3, 5, 64), (1, 2, 7, 128)])
def test_rope_fused_with_distinct_halves_is_the_rotate_half_formula_rounded_once(shape, seed):
    b, _, t, d = shape
    x = _rand_bf16(shape, seed, scale=3.0)
    cos, sin = _distinct_tables(b, t, d, seed)
    want32 = _ref_rope_fp32(x, cos, sin)
    assert torch.equal(regions.rope_fused(x, cos, sin), want32.to(BF16))  # round to nearest even, once
    assert torch.equal(regions.rope_fused(x, cos, sin, out_dtype=F32), want32)
    assert torch.equal(regions.rope_fused_rz(x, cos, sin), _truncate_to_bf16(want32))  # vLLM-CPU's C++ kernel
    # fp32 x (Qwen3's q/k-norm value kept fp32 into RoPE): now the products themselves round to fp32
    x32 = x.float() * torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=F32)
    assert torch.equal(regions.rope_fused(x32, cos, sin), _ref_rope_fp32(x32, cos, sin).to(BF16))
    # and the region kernels' node (the path the patched attention runs) gives the same bits
    K = regions.region_kernels("eager")
    assert torch.equal(K.rope_fused(x, cos, sin), want32.to(BF16))
    assert torch.equal(K.rope_fused_rz(x, cos, sin), _truncate_to_bf16(want32))


@pytest.mark.parametrize("seed", [0, 1])
def test_rope_hf_with_distinct_halves_rounds_each_product_then_the_sum(seed):
    shape = (2, 3, 5, 64)
    x = _rand_bf16(shape, seed, scale=3.0)
    cos, sin = _distinct_tables(2, 5, 64, seed)
    # bf16 * bf16 is exact in float64: one rounding to bf16 per product; the bf16 sum rounds through fp32 as torch's
    # CPU bf16 add does (fp32 has 24 >= 2*8 + 2 bits: that is the bf16 sum correctly rounded)
    p1 = (x.to(F64) * cos.to(F64)).to(BF16)
    p2 = (_rotate_half64(x.to(F64)) * sin.to(F64)).to(BF16)
    want = (p1.to(F64) + p2.to(F64)).to(F32).to(BF16)
    got = regions.rope_hf(x, cos, sin)
    assert torch.equal(got, want)
    assert not torch.equal(got, regions.rope_fused(x, cos, sin))  # three roundings are not one


@pytest.mark.parametrize("seed", [0, 1])
def test_rope_backward_with_distinct_halves_is_the_transposed_rotation(seed):
    """d/dx of x*cos + rotate_half(x)*sin applied to g: g*cos + rotate_half^T(g*sin), rotate_half^T(v) = (v2, -v1):
    float64 autograd of the formula (two exact products, summed) rounded through fp32 to x's dtype, bitwise, for the
    node that saves only cos/sin (hand-written backward) and for plain autograd of ``rope_fused``."""
    shape = (2, 3, 5, 64)
    x = _rand_bf16(shape, seed)
    cos, sin = _distinct_tables(2, 5, 64, seed)
    g = _rand_bf16(shape, seed + 50)
    x64 = x.to(F64).requires_grad_(True)
    out64 = x64 * cos.to(F64) + _rotate_half64(x64) * sin.to(F64)
    (want,) = torch.autograd.grad(out64, x64, g.to(F64))
    want = want.to(F32).to(BF16)
    for fn in (regions.region_kernels("eager").rope_fused, regions.rope_fused):
        xl = x.clone().requires_grad_(True)
        (got,) = torch.autograd.grad(fn(xl, cos, sin), xl, g)
        assert torch.equal(got, want), fn


# ---------------------------------------------------------------------------------------------------------------
# the vllm-cpu-eager residual row


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


# ---------------------------------------------------------------------------------------------------------------
# checkpoints: the in-process paths of resume and rotation, without a training run. tests/test_checkpoints.py covers
# them end to end (real SIGKILLs, ~10-40 s each); ``make mutation`` deselects those and relies on these.


def _ckpt(root, step, complete=True, state="{}"):
    from roundalign.training import checkpoints as C

    ckpt = root / f"checkpoint-{step}"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.pt").write_bytes(b"o" * (10 + step))
    (ckpt / "trainer_state.json").write_text(state)
    if complete:
        C.mark_complete(ckpt)
    return ckpt


def test_checkpoints_are_listed_by_step_number_and_only_checkpoint_dirs(tmp_path):
    from roundalign.training import checkpoints as C

    assert C.checkpoints(tmp_path / "absent") == []
    for name in ("checkpoint-10", "checkpoint-2", "checkpoint-9", "checkpoint-x", "checkpoint-3-old", "incomplete"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-4").write_text("a file, not a checkpoint")
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9", "checkpoint-10"]
    assert C.step_of(tmp_path / "checkpoint-10") == 10


def test_latest_complete_sets_aside_every_newer_incomplete_one_under_a_fresh_name(tmp_path, monkeypatch):
    from roundalign.training import checkpoints as C

    monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", "0")
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 4)
    _ckpt(tmp_path, 6, complete=False)
    _ckpt(tmp_path, 8, state="{not json")
    for taken in ("checkpoint-6", "checkpoint-6.1"):  # names already taken by earlier set-asides
        (tmp_path / "incomplete" / taken).mkdir(parents=True)
    lines = []
    got, aside = C.latest_complete(tmp_path, log=lines.append)
    assert got == tmp_path / "checkpoint-4"
    assert [(r["checkpoint"], r["moved_to"]) for r in aside] == [
        ("checkpoint-8", str(tmp_path / "incomplete" / "checkpoint-8")),
        ("checkpoint-6", str(tmp_path / "incomplete" / "checkpoint-6.2"))]
    assert aside[0]["problem"].startswith("trainer_state.json unreadable (")
    assert aside[1]["problem"] == f"no {C.MARKER} (the save did not finish)"
    assert lines == [f"[train] checkpoint-8 is incomplete ({aside[0]['problem']}): moved to {aside[0]['moved_to']}; "
                     "resuming from an earlier one",
                     f"[train] checkpoint-6 is incomplete ({aside[1]['problem']}): moved to {aside[1]['moved_to']}; "
                     "resuming from an earlier one"]
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4"]
    assert (tmp_path / "incomplete" / "checkpoint-6.2" / "optimizer.pt").is_file()  # moved, not deleted
    # nothing complete left: None, and every one set aside
    (tmp_path / "checkpoint-2" / "optimizer.pt").unlink()
    (tmp_path / "checkpoint-4" / C.MARKER).write_text("[]")
    got, aside = C.latest_complete(tmp_path, log=lines.append)
    assert got is None and [r["checkpoint"] for r in aside] == ["checkpoint-4", "checkpoint-2"]
    assert aside[0]["problem"].startswith(f"{C.MARKER} unreadable (") and aside[1]["problem"] == "optimizer.pt is missing"


def test_rotate_keeps_the_newest_complete_ones_and_never_touches_an_incomplete_one(tmp_path, monkeypatch):
    from roundalign.training import checkpoints as C

    monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", "0")
    for step in (2, 4, 6):
        _ckpt(tmp_path, step)
    _ckpt(tmp_path, 8, complete=False)  # being written
    assert C.rotate(tmp_path, 0) == [] and C.rotate(tmp_path, None) == [] and C.rotate(tmp_path, -1) == []
    assert C.rotate(tmp_path, 2) == [tmp_path / "checkpoint-2"]
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert C.rotate(tmp_path, 1) == [tmp_path / "checkpoint-4"]
    assert [p.name for p in C.checkpoints(tmp_path)] == ["checkpoint-6", "checkpoint-8"]


@pytest.mark.parametrize("value,flushed", [("1", True), ("0", False), ("", False), (None, True)])
def test_mark_complete_flushes_unless_told_not_to_and_records_it(tmp_path, monkeypatch, value, flushed):
    from roundalign.training import checkpoints as C

    if value is None:
        monkeypatch.delenv("ROUNDALIGN_CKPT_FSYNC", raising=False)
    else:
        monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", value)
    calls = []
    monkeypatch.setattr(C, "_fsync", lambda p: calls.append(p))
    ckpt = _ckpt(tmp_path, 12, complete=False)
    marker = C.mark_complete(ckpt)
    assert marker == {"step": 12, "fsync": flushed, "files": {"optimizer.pt": 22, "trainer_state.json": 2}}
    assert json.loads((ckpt / C.MARKER).read_text()) == marker
    assert bool(calls) is flushed


def _safetensors(path, header: bytes, data: bytes, n=None):
    path.write_bytes(struct.pack("<Q", len(header) if n is None else n) + header + data)


def test_verify_names_each_way_a_checkpoint_can_be_incomplete(tmp_path, monkeypatch):
    from roundalign.training import checkpoints as C

    monkeypatch.setenv("ROUNDALIGN_CKPT_FSYNC", "0")
    ckpt = _ckpt(tmp_path, 2, complete=False)
    w = ckpt / "model.safetensors"
    good = json.dumps({"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                       "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}).encode()
    _safetensors(w, good, b"\0" * 12)
    C.mark_complete(ckpt)
    assert C.verify(ckpt) is None

    def redo(header, data, n=None):
        _safetensors(w, header, data, n)
        C.mark_complete(ckpt)  # sizes match the marker: only the header can tell
        return C.verify(ckpt)

    assert redo(good, b"\0" * 11) == f"model.safetensors: safetensors data ends at {8 + len(good) + 12} bytes, file " \
                                      f"has {8 + len(good) + 11}"
    assert redo(good, b"\0" * 12, n=len(good) + 13) == (f"model.safetensors: safetensors header length "
                                                        f"{len(good) + 13} exceeds the file")
    # a length of exactly the rest of the file passes the length check; the header read then runs into the data
    assert redo(good, b"\0" * 12, n=len(good) + 12).startswith("model.safetensors: safetensors header unreadable (")
    assert redo(b"{\xff" + good[2:], b"\0" * 12).startswith("model.safetensors: safetensors header unreadable (")
    assert redo(b"[1, 2" + good[5:], b"\0" * 12).startswith("model.safetensors: safetensors header unreadable (")
    w.write_bytes(b"1234567")
    C.mark_complete(ckpt)
    assert C.verify(ckpt) == "model.safetensors: shorter than a safetensors header"
    # metadata-only header: no tensors, the data ends right after it
    assert redo(json.dumps({"__metadata__": {}}).encode(), b"") is None
    (ckpt / "trainer_state.json").unlink()
    C.mark_complete(ckpt)
    assert C.verify(ckpt) == "trainer_state.json was not written"
    (ckpt / C.MARKER).write_text(json.dumps({"step": 2}))
    assert C.verify(ckpt) == f"{C.MARKER} unreadable ('files')"


def test_fault_point_kills_its_process_once_at_its_point_and_step(tmp_path):
    """The kill itself, in a child process running the same ``checkpoints`` module as this test (under
    ``make mutation``: the mutated copy)."""
    from roundalign.training import checkpoints as C

    src = str(Path(C.__file__).resolve().parents[2])
    once = tmp_path / "once"
    os.environ.pop("ROUNDALIGN_FAULT_INJECT", None)
    C.fault_point("after_model", 3)  # unset: nothing happens (and mutmut maps this test to fault_point)

    def run(spec, point="after_model", step=3, where="/runs/x/full/checkpoints"):
        code = ("import sys; from roundalign.training import checkpoints as C; "
                f"C.fault_point({point!r}, {step}, {where!r}); sys.exit(7)")
        env = {**os.environ, "ROUNDALIGN_FAULT_INJECT": spec, "PYTHONPATH": src}
        if env.get("MUTANT_UNDER_TEST") == "stats":  # mutmut's coverage pass: the child needs no mutant (and has
            del env["MUTANT_UNDER_TEST"]              # no pyproject.toml in its cwd to record hits with)
        return subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120).returncode

    assert run("after_model@3") == -signal.SIGKILL
    assert run("after_model@3") == -signal.SIGKILL  # without a once-file: every time
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and nothing written
    assert run("after_model@4") == 7 and run("after_rng@3") == 7
    assert run("after_model@3@@/full/") == -signal.SIGKILL and run("after_model@3@@/baseline/") == 7
    assert run(f"after_model@3@{once}") == -signal.SIGKILL
    assert once.read_text() == f"after_model@3@{once}\n"  # written before the kill
    assert run(f"after_model@3@{once}") == 7  # the retried job gets past it



# ---------------------------------------------------------------------------------------------------------------
# small exact behaviours that survived ``make mutation`` (each assertion names what it pins)


def test_round_toward_zero_truncates_bf16_only_and_keeps_the_requested_dtype():
    x = torch.tensor([1.0 + 2.0**-8 + 2.0**-10, -(1.0 + 2.0**-8 + 2.0**-10), 3.0], dtype=F32)
    got = regions.round_toward_zero(x, BF16)
    assert got.dtype == BF16 and got.tolist() == [1.0, -1.0, 3.0]  # RNE would give 1 + 2^-7
    half = regions.round_toward_zero(x, torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, x.to(torch.float16))  # other dtypes: to nearest
    assert regions.round_toward_zero(x, F32).dtype == F32
    cos, sin = _distinct_tables(1, 3, 8, 0)
    xb = _rand_bf16((1, 1, 3, 8), 0)
    out = regions.rope_fused_rz(xb, cos, sin, out_dtype=F32)  # fp32 out: nothing to truncate
    assert out.dtype == F32 and torch.equal(out, _ref_rope_fp32(xb, cos, sin))


def test_numerics_package_resolves_the_patch_names_lazily():
    import roundalign.numerics as N
    from roundalign.numerics import patch

    for name in ("SUPPORTED_MODEL_CLASSES", "alignment_of", "apply_alignment"):
        assert N.__getattr__(name) is getattr(patch, name)
    with pytest.raises(AttributeError, match=r"^module 'roundalign.numerics' has no attribute 'nope'$"):
        N.__getattr__("nope")


def _token(**kw):
    base = {"is_ratio_mean": 1.0, "ess_frac": 1.0, "is_ratio_std": 0.0, "mismatch_k1": 0.0, "mismatch_chi2": 0.0}
    return {k: torch.tensor(v, dtype=F64) for k, v in {**base, **kw}.items()}


@pytest.mark.parametrize("kw,flag", [
    ({"is_ratio_mean": 0.49}, "is_mean"), ({"is_ratio_mean": 2.01}, "is_mean"), ({"ess_frac": 0.29}, "ess"),
    ({"is_ratio_std": 1.01}, "is_std"), ({"mismatch_k1": -0.11}, "kl"), ({"mismatch_k1": 0.11}, "kl"),
    ({"mismatch_chi2": 1.01}, "chi2"),
    # each threshold itself is healthy (verl warns strictly beyond it)
    ({"is_ratio_mean": 0.5}, None), ({"is_ratio_mean": 2.0}, None), ({"ess_frac": 0.3}, None),
    ({"is_ratio_std": 1.0}, None), ({"mismatch_k1": -0.1}, None), ({"mismatch_chi2": 1.0}, None)])
def test_each_verl_flag_alone_sets_any_and_thresholds_are_strict(kw, flag):
    from roundalign.metrics import verl_health_flags

    flags = verl_health_flags(_token(**kw))
    assert all(v.dtype == F64 for v in flags.values())
    want = {k: float(k == flag) for k in ("is_mean", "ess", "is_std", "kl", "chi2")}
    assert {k: float(v) for k, v in flags.items()} == {**want, "any": float(flag is not None)}


def test_mismatch_metrics_errors_name_the_input_and_an_is_clip_of_one_is_allowed():
    from roundalign.metrics import mismatch_metrics

    t = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    cases = [
        (([[0.0]], t, m), "train_logp must be a torch.Tensor, got list"),
        ((t, [[0.0]], m), "engine_logp must be a torch.Tensor, got list"),
        ((t, torch.zeros(2, 3, dtype=torch.int64), m), "engine_logp must be a floating-point tensor, got dtype torch.int64"),
        ((torch.zeros(2, 3, dtype=torch.int32), t, m), "train_logp must be a floating-point tensor, got dtype torch.int32"),
        ((t, t, m.float()), r"mask must be a torch.bool tensor \(True = completion token\), got torch.float32"),
        ((t, t, [[True]]), r"mask must be a torch.bool tensor \(True = completion token\), got list"),
        ((t, torch.zeros(2, 4), m), r"input shapes must all match \(B, T\): train_logp=\(2, 3\), engine_logp=\(2, 4\), "
                                    r"mask=\(2, 3\)$"),
        ((t, t, ~m), r"^mask selects no tokens: mismatch metrics need at least one completion token \(mask shape \(2, 3\)\)$"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            mismatch_metrics(*args)
    with pytest.raises(ValueError, match=r"entropy must be a torch.Tensor, got str"):
        mismatch_metrics(t, t, m, entropy="high")
    with pytest.raises(ValueError, match=r"input shapes must all match \(B, T\): .*mask=\(2, 3\), entropy=\(3,\)$"):
        mismatch_metrics(t, t, m, entropy=torch.zeros(3))
    # is_clip = 1: the band is [1, 1]; a ratio of exactly 1 is inside it, any other ratio outside
    out = mismatch_metrics(t, torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, -0.5]]), m, is_clip=1.0)["token"]
    assert out["is_ratio_outside_frac"].item() == 2 / 6


def test_set_aside_takes_the_first_free_name_starting_at_dot_one(tmp_path):
    from roundalign.training import checkpoints as C

    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "incomplete" / "checkpoint-2").mkdir(parents=True)
    rec = C.set_aside(tmp_path / "checkpoint-2", "why")
    assert rec == {"checkpoint": "checkpoint-2", "problem": "why", "moved_to": str(tmp_path / "incomplete/checkpoint-2.1")}


def test_rounding_plan_accepts_every_documented_value_and_names_what_it_refuses():
    from roundalign.numerics.plan import RoundingPlan

    RoundingPlan(rope="fused-rz")
    RoundingPlan(rope="fused", norm="fused", qk_norm_rope="fused")
    for residual in ("fp32", "fp32-stream"):
        RoundingPlan(norm="fused", residual=residual)
        with pytest.raises(ValueError, match=rf"^RoundingPlan: residual='{residual}' needs norm='fused' \(a compiled "
                                             r"engine fuses the norm that reads the fp32 sum\)$"):
            RoundingPlan(residual=residual)
    with pytest.raises(ValueError, match=r"^RoundingPlan.swiglu='fp32', expected one of \['hf', 'fused'\]$"):
        RoundingPlan(swiglu="fp32")
    with pytest.raises(ValueError, match=r"^RoundingPlan: qk_norm_rope='fused' needs both norm and rope 'fused'$"):
        RoundingPlan(rope="fused-rz", norm="fused", qk_norm_rope="fused")


@pytest.mark.parametrize("avx512,bf16,build,rope", [(True, True, "_C", "fused"), (True, False, "_C_AVX512", "fused-rz"),
                                                    (False, True, "_C_AVX2", "fused-rz")])
def test_cpu_kernel_build_and_its_rope_rounding(monkeypatch, avx512, bf16, build, rope):
    from roundalign.numerics import plan

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16)
    assert plan.cpu_kernel_build() == build
    assert plan.cpu_rope_rounding() == rope == plan.cpu_rope_rounding(build)
    assert plan.engine_plan("vllm-cpu-eager").rope == rope
    assert plan.cpu_rope_rounding("_C") == "fused" and plan.cpu_rope_rounding("_C_AVX2") == "fused-rz"


def test_row_chunks_cover_every_row_once_in_chunks_of_the_element_budget(monkeypatch):
    monkeypatch.setattr(regions, "_SWIGLU_CHUNK_ELEMS", 8)
    monkeypatch.setattr(regions, "_SWIGLU_CHUNK_ELEMS_ACCELERATOR", 4)
    a = torch.arange(3 * 5 * 4, dtype=F32).reshape(3, 5, 4)
    b = -a
    chunks = list(regions._row_chunks(a, b))
    assert [tuple(x.shape) for x, _ in chunks] == [(2, 4)] * 7 + [(1, 4)]  # 15 rows of 4: 8 elements = 2 rows
    assert torch.equal(torch.cat([x for x, _ in chunks]), a.reshape(15, 4))
    assert torch.equal(torch.cat([y for _, y in chunks]), b.reshape(15, 4))
    wide = torch.zeros(2, 3, 16)  # a row wider than the budget: one row per chunk
    assert [tuple(x.shape) for (x,) in regions._row_chunks(wide)] == [(1, 16)] * 6
    narrow = torch.zeros(20, 1)  # rows of one element: the budget is 8 rows (not 4: a row is never counted as two)
    assert [tuple(x.shape) for (x,) in regions._row_chunks(narrow)] == [(8, 1), (8, 1), (4, 1)]
    off_cpu = torch.empty(3, 5, 4, device="meta")  # not the CPU: the accelerator's budget (4 elements = 1 row)
    assert [tuple(x.shape) for (x,) in regions._row_chunks(off_cpu)] == [(1, 4)] * 15
    # and the chunked SwiGLU region gives the unchunked bits
    gate, up = _rand_bf16((3, 5, 4), 0, 4.0), _rand_bf16((3, 5, 4), 1)
    assert torch.equal(regions._swiglu_fused_chunked(gate, up), regions.swiglu_fused(gate, up))


def test_add_rmsnorm_bf16_sum_passes_its_reduction_order_on():
    x, r, w = _rand_bf16((2, 64), 0), _rand_bf16((2, 64), 1), _rand_bf16((64,), 2).abs()
    with pytest.raises(ValueError, match="does not tile a row of 64 elements"):
        regions.add_rmsnorm_bf16_sum(x, r, w, 1e-6, sum_order=(16, 3))
    got, s = regions.add_rmsnorm_bf16_sum(x, r, w, 1e-6, sum_order=(8, 2))
    assert torch.equal(s, x + r) and torch.equal(got, regions.rmsnorm_fused(x + r, w, 1e-6, sum_order=(8, 2)))


def _np_sum_sq_in_order(x: np.ndarray, vec: int, n: int) -> np.ndarray:
    """The order ``sum_sq_in_order`` documents, in numpy float32, element by element: lane k of the n*vec-wide
    accumulator adds the squares of elements k, k + n*vec, ... in row order; the n vectors are added one after
    another; then the vec lanes fold by halves (lane l += lane l + half)."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    out = np.empty(rows.shape[0], dtype=np.float32)
    width = vec * n
    for i, row in enumerate(rows):
        acc = [np.float32(0)] * width
        for j in range(0, row.size, width):
            for k in range(width):
                acc[k] = np.float32(acc[k] + np.float32(row[j + k] * row[j + k]))
        v = acc[:vec]
        for m in range(1, n):
            v = [np.float32(v[l] + acc[m * vec + l]) for l in range(vec)]
        half = vec // 2
        while half:
            v = [np.float32(v[l] + v[l + half]) for l in range(half)]
            half //= 2
        out[i] = v[0]
    return out.reshape(*x.shape[:-1], 1)


@pytest.mark.parametrize("vec,n", [(8, 1), (4, 2), (16, 2), (2, 4), (1, 1), (1, 4)])  # vec 1: scalar lanes (2**0)
def test_sum_sq_in_order_is_the_documented_order_bitwise(vec, n):
    g = torch.Generator().manual_seed(vec * 10 + n)
    x = torch.randn(3, 2, 64, generator=g) * torch.logspace(-3, 3, 64)  # magnitudes over 6 decades: order matters
    got = regions.sum_sq_in_order(x, (vec, n))
    want = _np_sum_sq_in_order(x.numpy(), vec, n)
    assert got.shape == (3, 2, 1) and got.dtype == F32
    assert np.array_equal(got.numpy(), want)
    with pytest.raises(ValueError, match=r"^reduction order \(vec=3, n=1\) does not tile a row of 64 elements: vec "
                                         r"must be a power of two and the row a multiple of vec \* n$"):
        regions.sum_sq_in_order(x, (3, 1))
    for bad in ((0, 1), (8, 0), (16, 3)):
        with pytest.raises(ValueError):
            regions.sum_sq_in_order(x, bad)
    assert np.array_equal(regions.rmsnorm_fused(x, torch.ones(64), 1e-6, sum_order=(vec, n), keep_fp32=True).numpy(),
                          (x * torch.rsqrt(torch.from_numpy(want) / 64 + 1e-6)).numpy())



@pytest.mark.parametrize("dtype", [BF16, F32])
def test_eager_region_nodes_compute_their_formula_and_its_gradients(dtype):
    """Each eager region node (what a patched model calls) against the plain formula: forward bitwise, gradients
    bitwise those of autograd on the formula (the node recomputes it in backward), for bf16 and fp32 inputs."""
    K = regions.region_kernels("eager")
    assert K.mode == "eager" and regions.region_kernels("eager") is K
    x, r = _rand_bf16((2, 3, 64), 0).to(dtype), _rand_bf16((2, 3, 64), 1, 4.0).to(dtype)
    w = (_rand_bf16((64,), 2).abs() + 0.5).to(dtype)
    cases = {
        "swiglu_fused": ((x, r), {}),
        "rmsnorm_fused": ((x, w), {"eps": 1e-6}),
        "add_rmsnorm_fp32_sum": ((x, r, w), {"eps": 1e-6}),
        "add_rmsnorm_bf16_sum": ((x, r, w), {"eps": 1e-6}),
    }
    for name, (inputs, kw) in cases.items():
        formula = getattr(regions, name)
        a = [t.clone().requires_grad_(True) for t in inputs]
        b = [t.clone().requires_grad_(True) for t in inputs]
        got, want = getattr(K, name)(*a, **kw), formula(*b, **kw)
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        assert all(g.dtype == v.dtype and torch.equal(g, v) for g, v in zip(got, want)), name
        grads = [_rand_bf16(v.shape, 7 + i).to(v.dtype) for i, v in enumerate(want)]
        torch.autograd.backward(got, grads)
        torch.autograd.backward(want, grads)
        for i, (ga, gb) in enumerate(zip(a, b)):
            assert ga.grad.dtype == gb.grad.dtype == dtype and torch.equal(ga.grad, gb.grad), (name, i)
    cos, sin = _distinct_tables(2, 3, 64, 0)
    q = x.reshape(2, 1, 3, 64).clone().requires_grad_(True)
    q2 = q.detach().clone().requires_grad_(True)
    for name in ("rope_fused", "rope_fused_rz"):
        out = getattr(K, name)(q, cos, sin)
        assert torch.equal(out, getattr(regions, name)(q2, cos, sin)) and out.dtype == BF16, name
    # cos/sin that need gradients (not HF's buffers) go through the recomputing node: x, cos and sin all get theirs
    c, s_ = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
    c2, s2 = cos.clone().requires_grad_(True), sin.clone().requires_grad_(True)
    g = _rand_bf16((2, 1, 3, 64), 9)
    torch.autograd.backward(K.rope_fused(q, c, s_, out_dtype=F32), g.float())
    torch.autograd.backward(regions.rope_fused(q2, c2, s2, out_dtype=F32), g.float())
    assert torch.equal(q.grad, q2.grad) and torch.equal(c.grad, c2.grad) and torch.equal(s_.grad, s2.grad)
    with pytest.raises(TypeError, match="^rmsnorm_fused: pass non-tensor arguments by keyword in the kernel namespace$"):
        K.rmsnorm_fused(x, w, 1e-6)
    with pytest.raises(ValueError, match=r"^unknown region kernel mode 'fast'; valid: eager, compiled$"):
        regions.region_kernels("fast")


# ---------------------------------------------------------------------------------------------------------------
# region nodes whose inputs do not all need a gradient (frozen weights, as under LoRA; tables that need one)


def _ref_rmsnorm32(x, w, eps):
    """vLLM's RMSNorm native formula written out in fp32 autograd ops: x * rsqrt(mean(x^2) + eps) * w, one rounding
    to w's dtype at the end."""
    xf = x.to(F32)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(F32)).to(w.dtype)


@pytest.mark.parametrize("frozen", ["weight", "x"])
def test_region_node_with_a_frozen_input_gives_the_others_autograd_gradient_and_it_none(frozen):
    """A norm weight frozen (requires_grad False: LoRA, or a frozen layer): the bf16 node's input gradient is
    bitwise plain autograd's on the formula written here, and the frozen input gets none (and the reverse)."""
    K = regions.region_kernels("eager")
    x, r = _rand_bf16((2, 3, 64), 20, 3.0), _rand_bf16((2, 3, 64), 21)
    w = _rand_bf16((64,), 22).abs() + 0.5
    g = _rand_bf16((2, 3, 64), 23)
    for name in ("rmsnorm_fused", "add_rmsnorm_fp32_sum"):
        xa, xb = x.clone().requires_grad_(frozen != "x"), x.clone().requires_grad_(frozen != "x")
        ra, rb = r.clone().requires_grad_(True), r.clone().requires_grad_(True)
        wa, wb = w.clone().requires_grad_(frozen != "weight"), w.clone().requires_grad_(frozen != "weight")
        if name == "rmsnorm_fused":
            got, want = K.rmsnorm_fused(xa, wa, eps=1e-6), _ref_rmsnorm32(xb, wb, 1e-6)
            free_a, free_b = [t for t in (xa, wa) if t.requires_grad], [t for t in (xb, wb) if t.requires_grad]
            outs = [(got, want, g)]
        else:
            (got, s_a), s_b = K.add_rmsnorm_fp32_sum(xa, ra, wa, eps=1e-6), xb.to(F32) + rb.to(F32)
            want = _ref_rmsnorm32(s_b, wb, 1e-6)  # the norm reads the unrounded fp32 sum; the stream is it rounded
            free_a, free_b = [t for t in (xa, ra, wa) if t.requires_grad], [t for t in (xb, rb, wb) if t.requires_grad]
            outs = [(got, want, g), (s_a, s_b.to(BF16), g.flip(-1))]
        assert all(torch.equal(a, b) for a, b, _ in outs), name
        torch.autograd.backward([a for a, _, _ in outs], [gg for _, _, gg in outs])
        torch.autograd.backward([b for _, b, _ in outs], [gg for _, _, gg in outs])
        assert len(free_a) == len(free_b) >= 1
        for ta, tb in zip(free_a, free_b):
            assert ta.grad is not None and ta.grad.dtype == BF16 and torch.equal(ta.grad, tb.grad), (name, frozen)
        frozen_a = wa if frozen == "weight" else xa
        assert frozen_a.grad is None, name


@pytest.mark.parametrize("needs", ["gate", "up"])
def test_swiglu_node_with_one_frozen_input_gives_the_other_its_gradient(needs):
    """silu(gate) * up in fp32, rounded once: d/dgate = g*up*s*(1 + gate*(1 - s)), d/dup = g*silu(gate), s the
    sigmoid; plain autograd of that formula written here, bitwise, for the input that needs a gradient; none for the
    other."""
    K = regions.region_kernels("eager")
    gate, up, g = _rand_bf16((3, 5, 32), 30, 3.0), _rand_bf16((3, 5, 32), 31), _rand_bf16((3, 5, 32), 32)
    ga, ua = gate.clone().requires_grad_(needs == "gate"), up.clone().requires_grad_(needs == "up")
    gb, ub = gate.clone().requires_grad_(needs == "gate"), up.clone().requires_grad_(needs == "up")
    got = K.swiglu_fused(ga, ua)
    want = (torch.nn.functional.silu(gb.to(F32)) * ub.to(F32)).to(BF16)
    assert torch.equal(got, want)
    got.backward(g)
    want.backward(g)
    live_a, dead_a, live_b = (ga, ua, gb) if needs == "gate" else (ua, ga, ub)
    assert live_a.grad is not None and torch.equal(live_a.grad, live_b.grad) and dead_a.grad is None


@pytest.mark.parametrize("table", ["cos", "sin"])
def test_rope_node_with_only_one_table_needing_a_gradient_gives_it_its_gradient(table):
    """cos (or sin alone) a learned tensor: its gradient is g*x (for sin: g*rotate_half(x)), each product exact in
    fp32 and rounded once to the table's dtype; x's is the transposed rotation (as for HF's buffers)."""
    K = regions.region_kernels("eager")
    x, g = _rand_bf16((2, 1, 5, 64), 40, 3.0), _rand_bf16((2, 1, 5, 64), 41)
    cos, sin = _distinct_tables(2, 5, 64, 4)
    cos, sin = cos.clone().requires_grad_(table == "cos"), sin.clone().requires_grad_(table == "sin")
    xl = x.clone().requires_grad_(True)
    out = K.rope_fused(xl, cos, sin)
    assert torch.equal(out, _ref_rope_fp32(x, cos.detach(), sin.detach()).to(BF16))
    out.backward(g)
    x64, g64 = x.to(F64), g.to(F64)
    want_cos, want_sin = (g64 * x64).to(BF16), (g64 * _rotate_half64(x64)).to(BF16)
    learned, frozen, want = (cos, sin, want_cos) if table == "cos" else (sin, cos, want_sin)
    assert learned.grad is not None and torch.equal(learned.grad, want) and frozen.grad is None
    gs = g64 * sin.detach().to(F64)
    want_x = (g64 * cos.detach().to(F64) + torch.cat((gs[..., 32:], -gs[..., :32]), dim=-1)).to(F32).to(BF16)
    assert torch.equal(xl.grad, want_x)


def test_rope_node_asked_for_an_fp32_output_returns_the_unrounded_fp32_rotation():
    """The eager RoPE node (tables need no gradient: HF's buffers) with out_dtype=float32 (a fused norm+RoPE kernel
    keeping fp32): the fp32 rotation itself, not rounded to bf16; and its backward still gives x the transposed
    rotation."""
    K = regions.region_kernels("eager")
    x, g = _rand_bf16((2, 3, 5, 64), 50, 3.0), _rand_bf16((2, 3, 5, 64), 51).to(F32)
    cos, sin = _distinct_tables(2, 5, 64, 5)
    for name in ("rope_fused", "rope_fused_rz"):  # an fp32 output has no rounding, toward zero or otherwise
        xl = x.clone().requires_grad_(True)
        out = getattr(K, name)(xl, cos, sin, out_dtype=F32)
        assert out.dtype == F32 and torch.equal(out, _ref_rope_fp32(x, cos, sin)), name
        out.backward(g)
        gs = g.to(F64) * sin.to(F64)
        want = (g.to(F64) * cos.to(F64) + torch.cat((gs[..., 32:], -gs[..., :32]), dim=-1)).to(F32).to(BF16)
        assert torch.equal(xl.grad, want), name


def test_fp32_region_inputs_that_also_feed_the_residual_stream_accumulate_their_gradient_as_stock_autograd():
    """An fp32 model (eager kernels): an input that feeds the norm AND the residual add gets the gradient plain
    autograd of the written-out formula gives, bitwise (one node would sum the norm's share first; fp32 addition is
    not associative)."""
    K = regions.region_kernels("eager")
    g = torch.Generator().manual_seed(60)
    x = (torch.randn(4, 7, 64, generator=g) * torch.logspace(-2, 2, 64)).requires_grad_(True)
    w = (torch.rand(64, generator=g) + 0.5).requires_grad_(True)
    up = torch.randn(4, 7, 64, generator=g).requires_grad_(True)
    dy = torch.randn(4, 7, 64, generator=g)
    xb, wb, upb = (t.detach().clone().requires_grad_(True) for t in (x, w, up))

    def block(norm, swiglu, x, w, up):
        return x + swiglu(norm(x, w), up) + x * 0.75  # x: the norm's input, the residual, and one more use

    y = block(lambda a, b: K.rmsnorm_fused(a, b, eps=1e-6), K.swiglu_fused, x, w, up)
    yb = block(lambda a, b: _ref_rmsnorm32(a, b, 1e-6),
               lambda a, b: torch.nn.functional.silu(a.to(F32)) * b.to(F32), xb, wb, upb)
    assert torch.equal(y, yb)
    y.backward(dy)
    yb.backward(dy)
    for a, b in ((x, xb), (w, wb), (up, upb)):
        assert torch.equal(a.grad, b.grad)


def test_fault_point_in_process_reads_each_field_of_the_spec(monkeypatch, tmp_path):
    """fault_point's parsing, observed in this process (os.kill replaced by a recorder): a call without a
    directory matches no ``match`` text; a spec without a once-file or a match fires every time and writes
    nothing."""
    from roundalign.training import checkpoints as C

    kills = []
    monkeypatch.setattr(C.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.chdir(tmp_path)

    def fires(spec, *args):
        monkeypatch.setenv("ROUNDALIGN_FAULT_INJECT", spec)
        before = len(kills)
        C.fault_point(*args)
        return len(kills) > before

    assert fires("after_model@3", "after_model", 3) and kills[-1] == (os.getpid(), signal.SIGKILL)
    assert fires("after_model@3", "after_model", 3)  # no once-file: again
    assert not fires("after_model@3@@X", "after_model", 3)  # a match, and no directory given: "" has no "X"
    assert fires("after_model@3@@", "after_model", 3)  # an empty match matches anything
    assert fires("after_model@3@@X", "after_model", 3, "/a/X/b")
    assert not fires("after_model@4", "after_model", 3) and not fires("after_rng@3", "after_model", 3)
    assert list(tmp_path.iterdir()) == []  # nothing written without a once-file
    assert fires("after_model@3@once", "after_model", 3) and not fires("after_model@3@once", "after_model", 3)
    assert (tmp_path / "once").read_text() == "after_model@3@once\n"
    with pytest.raises(ValueError):  # a spec without a step, at its point
        fires("after_model", "after_model", 3)
    assert not fires("after_model", "after_rng", 3)  # ... and elsewhere nothing


def test_each_variant_copies_exactly_its_regions_of_the_engine_plan():
    """plan_for: "full" is the engine's plan; each single-region variant copies that region only (the rest HF)."""
    from roundalign.numerics.plan import ENGINES, RoundingPlan

    for engine in ENGINES:
        eng = engine_plan(engine)
        assert plan_for(engine, "full") == eng and plan_for(engine, "baseline") == RoundingPlan()
        assert plan_for(engine, "rope") == RoundingPlan(rope=eng.rope)
        assert plan_for(engine, "swiglu") == RoundingPlan(swiglu=eng.swiglu)
        assert plan_for(engine, "norm") == RoundingPlan(norm=eng.norm, residual=eng.residual)
        assert eng != RoundingPlan(norm=eng.norm, residual=eng.residual), engine  # so "full" is not "norm"


def test_add_rmsnorm_fp32_sum_passes_its_order_on_keeps_the_fp32_sum_on_request_and_refuses_an_order_for_hf():
    g = torch.Generator().manual_seed(70)
    x = (torch.randn(8, 64, generator=g) * torch.logspace(-3, 3, 64)).to(BF16)
    r = (torch.randn(8, 64, generator=g) * 8).to(BF16)
    w = torch.rand(64, generator=g) + 0.5  # an fp32 weight: the output is fp32, where the order shows
    s32 = x.to(F32) + r.to(F32)  # two bf16 values: their fp32 sum
    ss = torch.from_numpy(_np_sum_sq_in_order(s32.numpy(), 8, 2))
    want = s32 * torch.rsqrt(ss / 64 + 1e-6) * w
    normed, s = regions.add_rmsnorm_fp32_sum(x, r, w, 1e-6, sum_order=(8, 2))
    assert torch.equal(normed, want) and s.dtype == BF16 and torch.equal(s, s32.to(BF16))  # bitwise
    assert not torch.equal(normed, regions.add_rmsnorm_fp32_sum(x, r, w, 1e-6)[0])  # the order shows in these bits
    normed, s = regions.add_rmsnorm_fp32_sum(x, r, w, 1e-6, keep_fp32_sum=True)
    assert s.dtype == F32 and torch.equal(s, s32)
    with pytest.raises(ValueError, match=r"^a reduction order belongs to a compiled engine's fused norm, not to "
                                         r"norm='hf'$"):
        regions.add_rmsnorm_fp32_sum(x, r, w, 1e-6, norm="hf", sum_order=(8, 2))


def test_region_kernels_default_to_eager_and_compiled_mode_compiles_every_region(monkeypatch):
    """region_kernels() is the eager set; "compiled" wraps each region's formula with _compiled_kernel (replaced
    here by a recorder, so nothing is compiled)."""
    assert regions.region_kernels() is regions.region_kernels("eager")
    built = []
    monkeypatch.setattr(regions, "_compiled_kernel", lambda fn: built.append(fn.__name__) or fn)
    K = regions.region_kernels("compiled")
    assert K.mode == "compiled" and sorted(built) == sorted(regions._FUSED)


def test_compiled_norm_kernels_of_two_reduction_orders_keep_their_own_order():
    # regions._with_order binds each order under its own key of a module-level dict that the compiled graph reads
    # as a constant; one shared key would let the last order registered replace an earlier kernel's on its next
    # trace (Dynamo's guard on the dict entry fails and it retraces with the other order). Found by sampling the
    # compiled-mode survivors of make mutation against the slow tests: none of them noticed.
    from roundalign.numerics import regions as R

    K = R.region_kernels("compiled")
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(64, 256, generator=g) * 3).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16)
    want_a = R.rmsnorm_fused(x, w, 1e-6, sum_order=(16, 2), keep_fp32=True)  # the eager formula in that order
    want_b = R.rmsnorm_fused(x, w, 1e-6, sum_order=(8, 1), keep_fp32=True)
    want_c = R.rmsnorm_fused(x, w, 1e-6, sum_order=(4, 2), keep_fp32=True)  # a key of n alone would be (16, 2)'s
    assert not torch.equal(want_a, want_b) and not torch.equal(want_a, want_c)  # the orders differ on this data
    with torch.no_grad():
        first = K.rmsnorm_fused(x, w, eps=1e-6, sum_order=(16, 2), keep_fp32=True)
        other = K.rmsnorm_fused(x, w, eps=1e-6, sum_order=(8, 1), keep_fp32=True)
        third = K.rmsnorm_fused(x, w, eps=1e-6, sum_order=(4, 2), keep_fp32=True)
        again = K.rmsnorm_fused(x, w, eps=1e-6, sum_order=(16, 2), keep_fp32=True)
    assert torch.equal(first, want_a) and torch.equal(other, want_b) and torch.equal(third, want_c)
    assert torch.equal(again, want_a)


def _inductor_vjp(formula, inputs, grads, **kwargs):
    """The spec of a compiled region's backward, written here: Inductor's compile (dynamic shapes) of
    ``torch.func.vjp`` of the eager formula, with the formula's keywords bound in the traced function."""
    def vjp(xs, gs):
        out, pull = torch.func.vjp(lambda *a: formula(*a, **kwargs), *xs)
        return pull(gs if isinstance(out, tuple) else gs[0])
    torch._dynamo.reset()  # each call closes over other keywords: a fresh cache, clear of the recompile limit
    return torch.compile(vjp, dynamic=True)(tuple(inputs), tuple(grads))


@pytest.mark.parametrize("region", ["swiglu", "rmsnorm", "add_fp32_sum", "add_bf16_sum"])
def test_compiled_region_backward_is_inductors_compile_of_the_formulas_vjp(region):
    """A compiled region's first-order backward is Inductor's compile of the formula's VJP: bitwise the VJP compiled
    here, with the region's keywords (eps, the reduction order, keep_fp32) reaching it, an output that gets no
    gradient (a norm's residual sum) counted as zeros, and no gradient for an input that needs none. Within 2^-6
    (relative norm) of the eager formula's autograd: an Inductor-independent check that the right function is
    differentiated. tests/test_compiled_engine.py checks the forwards against the compiled engine; nothing checked
    this VJP alone."""
    from roundalign.numerics import regions as R

    K = R.region_kernels("compiled")
    g = torch.Generator().manual_seed(41)
    rows, d = 24, 128
    x = (torch.randn(rows, d, generator=g) * 3).to(BF16)
    other = (torch.randn(rows, d, generator=g) * 2).to(BF16)
    w = 1 + 0.1 * torch.randn(d, generator=g)  # an fp32 weight: its gradient is fp32, where the norm's order shows
    dy = torch.randn(rows, d, generator=g).to(BF16)
    if region == "swiglu":
        formula, kernel, inputs, kw, needs = R.swiglu_fused, K.swiglu_fused, [x, other], {}, [True, False]
    elif region == "rmsnorm":
        formula, kernel, inputs = R.rmsnorm_fused, K.rmsnorm_fused, [x, w]
        kw, needs = {"eps": 1e-6, "sum_order": (4, 1), "keep_fp32": True}, [True, True]
    else:
        name = {"add_fp32_sum": "add_rmsnorm_fp32_sum", "add_bf16_sum": "add_rmsnorm_bf16_sum"}[region]
        formula, kernel, inputs = getattr(R, name), getattr(K, name), [x, other, w]
        kw, needs = {"eps": 1e-6, "sum_order": (4, 1)}, [True, False, True]
    leaves = [t.detach().requires_grad_(n) for t, n in zip(inputs, needs)]
    out = kernel(*leaves, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    outs[0].backward(dy.to(outs[0].dtype))  # a norm's second output (the residual sum) gets no gradient
    got = [t.grad for t in leaves]
    assert [gr is not None for gr in got] == needs  # no gradient where none is needed
    grads = [dy.to(outs[0].dtype)] + [torch.zeros(o.shape, dtype=o.dtype) for o in outs[1:]]
    want = _inductor_vjp(formula, inputs, grads, **kw)
    assert len(want) == len(inputs)
    if "sum_order" in kw:  # the order reaches the VJP: without it, other bits
        unordered = _inductor_vjp(formula, inputs, grads, **{k: v for k, v in kw.items() if k != "sum_order"})
        assert not all(torch.equal(a, b) for a, b, n in zip(want, unordered, needs) if n)
    eager_leaves = [t.detach().requires_grad_(n) for t, n in zip(inputs, needs)]
    eager_out = formula(*eager_leaves, **kw)
    (eager_out[0] if isinstance(eager_out, tuple) else eager_out).backward(grads[0])
    for gr, wa, leaf, n in zip(got, want, eager_leaves, needs):
        if not n:
            continue
        assert gr.dtype == leaf.dtype and torch.equal(gr, wa)  # bitwise Inductor's compile of the VJP
        e = leaf.grad.float()  # rounding apart: eager autograd rounds its fp32 intermediates where Inductor fuses
        assert (gr.float() - e).norm() <= 2.0 ** -6 * e.norm()


# -- patch.py: what the fast mutation pass showed no test observing -------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("training", [False, True])
def test_aligned_attention_calls_the_attention_interface_as_stock_does(arch, training, monkeypatch):
    """The aligned attention re-states the stock forward around the attention call: it must hand the attention
    interface exactly the keywords stock transformers does (dropout in training only, the scaling, the layer's
    sliding window, and every keyword the decoder layer passes through, with the layer's defaults when a layer is
    called on its own). The tiny models use no sliding window and no dropout, so a dropped ``sliding_window`` or an
    inverted ``training`` test survived the suite: here each layer gets a window of 5 and a dropout of 0.25, and a
    recording attention function compares the two models' calls."""
    from transformers import AttentionInterface
    from transformers.models.qwen2.modeling_qwen2 import eager_attention_forward

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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_an_aligned_model_decodes_through_transformers_kv_cache(arch):
    """The aligned decoder layer hands its attention the cache (``past_key_values``), so cached decoding
    (``generate``, or a trainer's eval loop) sees every earlier token: the cache grows by one position per step,
    and each step's logits are the full forward's at that position (bf16 matmuls over other shapes apart). The
    engine tests decode through the emulated engine's own cache, not transformers', so a layer that dropped the
    cache survived them."""
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


def test_the_carrier_slot_is_empty_after_every_forward():
    """``_take_lo`` empties the trunk's carrier slot whenever it is read, so that nothing outlives one forward: after
    a forward, the slot holds no tensor (a slot left holding the last layer's output and its fp32 low part would keep
    both alive, and hand the low part to a later call that happens to pass that tensor again)."""
    from roundalign.numerics.patch import SLOT_ATTR

    model = apply_alignment(random_qwen("qwen2", layers=3), "full", "vllm-compiled")
    slots = {id(s): s for m in model.modules() if (s := getattr(m, SLOT_ATTR, None)) is not None}
    assert len(slots) == 1
    (slot,) = slots.values()
    for _ in range(2):
        with torch.no_grad():
            model(input_ids=torch.arange(10).view(1, 10))
        assert slot == {"out": None, "lo": None}


def test_alignment_of_a_never_aligned_model_and_the_aligned_classes_names():
    """``alignment_of`` of a model never aligned is the documented default; an aligned instance's class is the
    roundalign subclass named like the stock one, from roundalign.numerics.patch (pickling finds it there), with a
    docstring saying what it is (what ``help(layer)`` shows)."""
    from roundalign.numerics import patch

    assert patch.alignment_of(random_qwen("qwen3")) == ("baseline", "vllm-compiled", "eager")
    aligned = apply_alignment(random_qwen("qwen3"), "full", "vllm-cpu-compiled", kernels="eager")
    assert patch.alignment_of(aligned) == ("full", "vllm-cpu-compiled", "eager")
    for module, name in ((aligned.model.layers[0], "Qwen3DecoderLayer"), (aligned.model.norm, "Qwen3RMSNorm")):
        cls = type(module)
        assert (cls.__name__, cls.__qualname__, cls.__module__) == (name, name, "roundalign.numerics.patch")
        assert getattr(patch, name) is cls
        assert cls.__doc__ == f"{name} with roundalign's aligned forward (per instance)."


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_full_on_the_cpu_eager_engine_of_an_avx2_build_is_on_policy_and_needs_the_truncating_rope(arch, monkeypatch):
    """vLLM-CPU's eager RoPE truncates to bf16 in the _C_AVX512/_C_AVX2 builds (plan.cpu_rope_rounding: "fused-rz").
    This machine loads _C (AVX-512 BF16), so elsewhere the suite only ever takes "fused", and a patch that dropped
    the truncating branch survived every test here. With the build set to _C_AVX2, the emulated engine (which rounds
    with regions.rope_fused_rz, pinned against a truncation formula above) and the trainer aligned with ``full``
    give equal logprobs on every sampled token; the same trainer aligned for the _C build does not."""
    from roundalign.engine import Engine
    from roundalign.numerics import plan as plan_mod

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


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_norm_sum_orders_take_variant_norm_and_a_wrong_count_names_the_norms_the_model_runs(arch):
    """``norm_sum_orders`` apply to the variants that align the norms, ``norm`` as well as ``full``; a list of the
    wrong length is refused with the count and the norms this architecture runs (Qwen3's q/k norms included)."""
    from roundalign.numerics.patch import norm_modules

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


def test_the_recorded_alignment_is_exact_lives_in_the_models_own_config_and_baseline_removes_it():
    """apply_alignment records what it applied in the model's own copy of its config (what save_pretrained writes
    and load_model re-applies): exactly the variant, engine, kernels and any norm orders; a later apply rewrites it
    in the same config object (a user's reference to model.config stays the model's), and baseline removes it. A
    record older than the kernels choice reads as eager kernels."""
    from roundalign.numerics.patch import recorded_alignment

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


def test_a_model_whose_mlp_is_not_swiglu_is_refused_naming_its_activation():
    """The SwiGLU region is silu(gate) * up: a Qwen model configured with another activation is refused, naming
    it."""
    model = random_qwen("qwen2")
    model.config.hidden_act = "gelu"
    with pytest.raises(ValueError) as err:
        apply_alignment(model, "full", "vllm-compiled")
    assert str(err.value) == "roundalign aligns SwiGLU MLPs (hidden_act='silu'); this model has hidden_act='gelu'"


def test_another_architecture_is_refused_with_the_whole_message():
    """The message a Mistral user gets, whole: the class, every supported class, the families' notes and why."""
    from transformers import MistralConfig, MistralForCausalLM

    from roundalign.numerics.patch import SUPPORTED_MODEL_CLASSES

    mistral = MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    with pytest.raises(TypeError) as err:
        apply_alignment(mistral, "full")
    assert str(err.value) == (
        f"unsupported model class MistralForCausalLM; roundalign supports {', '.join(SUPPORTED_MODEL_CLASSES)} "
        "(Qwen2.5 checkpoints load as Qwen2; Llama 3 and 3.1 checkpoints, with their rope scaling). Other "
        "architectures round in other places and need their own family record (roundalign/numerics/families.py).")
    assert "LlamaForCausalLM" in SUPPORTED_MODEL_CLASSES and "Qwen3MoeForCausalLM" not in SUPPORTED_MODEL_CLASSES


def test_the_default_kernels_are_compiled_only_for_the_cpu_compiled_engine_on_bf16():
    """Against vLLM-CPU's compiled engine the regions default to Inductor-compiled kernels (which reduce the RMSNorm
    mean as the engine's graph does: every token bitwise in tests/vllm_cpu/test_real_engine.py, where eager kernels
    left 1 of 449 apart, a test that runs only in .venv-vllm); eager everywhere else, and on fp32 models."""
    from roundalign.numerics.patch import alignment_of, default_kernels

    assert [default_kernels(e) for e in ("vllm-compiled", "vllm-eager", "vllm-cpu-compiled", "vllm-cpu-eager")] == [
        "eager", "eager", "compiled", "eager"]
    assert default_kernels("vllm-cpu-compiled", torch.float32) == "eager"
    assert alignment_of(apply_alignment(random_qwen("qwen2"), "full", "vllm-cpu-compiled"))[2] == "compiled"


def test_the_train_configs_kernels_default_to_the_engines_mode_and_a_named_mode_stays():
    """TrainConfig's kernels=auto resolves to ``default_kernels``' choice when the config is built (run.json records
    the mode that ran): the trainer and ``apply_alignment`` pick the same kernels for an engine unless told, and a
    mode named explicitly stays."""
    from roundalign.training.config import build_config

    def kernels(**over):
        return build_config(overrides={"model": "x", **over}).kernels

    assert kernels(backend="vllm", engine="vllm-cpu-compiled") == "compiled"
    assert kernels(backend="vllm", engine="vllm-cpu-eager") == "eager"
    assert kernels(engine="vllm-cpu-compiled") == "compiled"  # the emulated compiled CPU engine too
    assert kernels(engine="vllm-compiled") == "eager" and kernels(engine="vllm-eager") == "eager"
    assert kernels(engine="vllm-cpu-compiled", variant="fp32") == "eager"  # fp32: the only bitwise no-op
    assert kernels(backend="vllm", engine="vllm-cpu-compiled", kernels="eager") == "eager"
    assert kernels(engine="vllm-eager", kernels="compiled") == "compiled"
