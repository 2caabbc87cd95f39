"""Qwen3-MoE against vLLM-CPU 0.31.0 itself (numerics/moe.py; docs/numerics.md, "Qwen3-MoE").

1. The expert kernel: ``_C.cpu_fused_moe`` called directly with random bf16 inputs, for the ISA vLLM picks on this CPU
   (``amx`` where the CPU has AMX tiles, ``vec`` else) and for ``vec`` everywhere; the emulation of that ISA gives
   its output bitwise, and inputs built to expose summation order tell the two ISAs' orders apart.
2. End to end: a tiny Qwen3-MoE built locally, sampled by the engine in both modes and rescored by the trainer:
   ``full`` with the engine's attention kernel gives every token the engine's log-prob bitwise (sampled through the
   KV cache and in one prefill), baseline does not. The engine is built with the live ``F.linear`` GEMM dispatch
   (``install_live_gemm_dispatch``), which training runs (TRL's weight sync needs it); with vLLM's stock dispatch on
   an AMX CPU the MoE router's small GEMM goes through SGL's ``weight_packed_linear``, whose sums differ from
   ``F.linear``'s for decode-sized batches (docs/numerics.md)."""

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from roundalign.bridge import vllm_cpu
from roundalign.models.tiny import make_tiny
from roundalign.numerics import moe

torch.set_num_threads(1)
AMX = bool(torch.cpu._is_amx_tile_supported())


def _kernel(x, w13, w2, weights, ids, isa):
    import vllm._custom_ops as ops  # noqa: PLC0415 -- optional: vllm

    vllm_cpu.request_amx()
    out = torch.empty_like(x)
    ops.cpu_fused_moe(out, x, ops.cpu_prepack_moe_weight(w13, isa), ops.cpu_prepack_moe_weight(w2, isa), None, None,
                      weights, ids.to(torch.int32), "silu", isa)
    return out


def _bf16(shape, gen, scale=1.0):
    return (scale * torch.randn(shape, generator=gen)).to(torch.bfloat16)


def test_this_cpu_takes_the_isa_vllm_picks():
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import X86CPUUnquantizedExperts  # noqa: PLC0415 -- optional: vllm

    assert X86CPUUnquantizedExperts._supports_current_device() == AMX
    assert moe.engine_isa() == ("amx" if AMX else "vec")


@pytest.mark.parametrize("isa", ["vec", pytest.param("amx", marks=pytest.mark.skipif(
    not AMX, reason="vLLM-CPU's AMX expert kernel needs a CPU with AMX tiles"))])
@pytest.mark.parametrize("tokens", [1, 4, 40])
@pytest.mark.parametrize("router", moe.ROUTERS)
def test_the_expert_emulation_is_the_kernel_bitwise(isa, tokens, router):
    gen = torch.Generator().manual_seed(tokens)
    E, H, inter, k = 8, 128, 64, 2
    x = _bf16((tokens, H), gen)
    w13, w2 = _bf16((E, 2 * inter, H), gen, H ** -0.5), _bf16((E, H, inter), gen, inter ** -0.5)
    weights, ids = moe.route(_bf16((tokens, E), gen, 2.0), k, True, router)
    want = _kernel(x, w13, w2, weights, ids, isa)
    got = moe.experts(x, w13, w2, weights, ids, isa)
    assert torch.equal(got, want)


@pytest.mark.skipif(not AMX, reason="the AMX kernel runs on a CPU with AMX tiles only")
def test_the_isas_sum_in_different_orders_and_each_emulation_has_its_own():
    """Inputs whose partial sums cancel (large terms and their negatives among small ones) make the order of the
    GEMM sums visible in the bf16 output; each ISA's emulation matches its kernel and not the other's."""
    gen = torch.Generator().manual_seed(0)
    H = inter = 64
    # the gate half gives g = 32 on every row (silu(32) = 32 exactly), the up half the cancelling sums
    n = (H - 1) * 2 // 5
    rows = []
    for _ in range(inter):
        big = ((torch.rand(n, generator=gen) + 1) * 2.0 ** torch.randint(6, 15, (n,), generator=gen).float()
               * (torch.randint(0, 2, (n,), generator=gen) * 2 - 1)).to(torch.bfloat16).float()
        small = _bf16((H - 1 - 2 * n,), gen).float()
        v = torch.cat([big, -big, small])
        rows.append(torch.cat([v[torch.randperm(H - 1, generator=gen)], torch.zeros(1)]))
    up = torch.stack(rows).to(torch.bfloat16)
    gate = torch.zeros(inter, H, dtype=torch.bfloat16)
    gate[:, H - 1] = 32
    w13 = torch.cat([gate, up])[None]
    w2 = torch.eye(H, dtype=torch.bfloat16)[None]  # the output is the activation itself
    x = torch.ones(4, H, dtype=torch.bfloat16)
    weights, ids = torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int64)
    got = {isa: _kernel(x, w13, w2, weights, ids, isa) for isa in moe.ISAS}
    emul = {isa: moe.experts(x, w13, w2, weights, ids, isa) for isa in moe.ISAS}
    assert not torch.equal(got["vec"], got["amx"])
    for isa in moe.ISAS:
        other = "amx" if isa == "vec" else "vec"
        assert torch.equal(emul[isa], got[isa]) and not torch.equal(emul[other], got[isa]), isa


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("m") / "tiny-qwen3-moe", hidden=128, layers=2, heads=4,
                     kv_heads=2, tie=False, seed=7, experts=8, top_k=2, moe_intermediate=64)


def _metric(csv, variant, metric):
    t = pd.read_csv(csv)
    return float(t.query("variant == @variant and metric == @metric and level == 'token'")["value"].iloc[0])


PROBE_WITH_LIVE_GEMMS = ("import sys\nfrom roundalign.bridge import vllm_cpu\nvllm_cpu.install_live_gemm_dispatch()\n"
                         "from roundalign.cli import main\nsys.exit(main(sys.argv[1:]))")


@pytest.mark.parametrize("engine", ["vllm-cpu-eager", "vllm-cpu-compiled"])
def test_full_is_bitwise_against_the_real_engine(tiny_moe, tmp_path, engine):
    out = tmp_path / "p.csv"
    cmd = [sys.executable, "-c", PROBE_WITH_LIVE_GEMMS, "probe", "--backend", "vllm", "--model", str(tiny_moe),
           "--out", str(out), "--prompts", "4", "--max-new-tokens", "8", "--variants", "baseline,full", "--engine",
           engine, "--trainer-attn", "vllm_cpu"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["vllm_engine"]["device_type"] == "cpu"
    assert set(meta["vllm_engine"]["kernels"]["gemm"]) == {vllm_cpu.LIVE_GEMM}, meta["vllm_engine"]["kernels"]
    for csv in (out, out.with_name("p_teacher_forced.csv")):  # sampled (through vLLM's KV cache) and one prefill
        assert _metric(csv, "full", "tokens_exact_frac") == 1.0 and _metric(csv, "full", "mismatch_k3") == 0.0, csv
        assert _metric(csv, "baseline", "tokens_exact_frac") < 0.5 and _metric(csv, "baseline", "mismatch_k3") > 0
    # the emulated engine beside the real one runs the same MoE block: bitwise with the trainer as well
    assert _metric(out.with_name("p_emulated.csv"), "full", "tokens_exact_frac") == 1.0
