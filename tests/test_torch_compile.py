"""``torch.compile`` of an aligned model: fullgraph traces, keeps the regions' rounding, and trains.

The reference is the same aligned model run eagerly (itself bitwise equal to the emulated engine,
tests/test_engine.py), and stock transformers compiled the same way: what Inductor does to a stock model
it does to an aligned one, and the claim is only that the alignment adds nothing of its own.

Inductor by default elides a bf16 downcast-upcast pair between two fused ops (a precision *increase*, also
for the explicit ``.to(bf16)`` of a region); ``emulate_precision_casts=True`` keeps every rounding of the
eager graph. The numbers of both settings are in docs/numerics.md ("torch.compile of an aligned model").
"""

import copy
import json
import warnings

import pytest
import torch
from conftest import random_qwen

from roundalign import apply_alignment
from roundalign.models.pretrain import pretrain_tiny
from roundalign.models.tiny import make_tiny
from roundalign.numerics import patch
from roundalign.training import train as train_mod
from roundalign.training.config import build_config
from roundalign.training.train import run_train

torch.set_num_threads(1)
IDS = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(3))
EMULATE = {"emulate_precision_casts": True}
# (engine, kernels): the default region kernels of a GPU target and of the CPU build's compiled target
TARGETS = [("vllm-compiled", "eager"), ("vllm-cpu-compiled", "compiled")]


def _model(arch, variant="full", engine="vllm-compiled", kernels="eager"):
    m = random_qwen(arch, attn="sdpa", layers=3)
    return apply_alignment(m, variant, engine=engine, kernels=kernels)


def _forward(model, ids=IDS, hidden=True):
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=hidden)
    return out.logits, out.hidden_states


@pytest.mark.parametrize("engine,kernels", TARGETS)
def test_compiled_aligned_model_is_bitwise_the_eager_one(arch, engine, kernels):
    torch._dynamo.reset()
    model = _model(arch, engine=engine, kernels=kernels)
    want_logits, want_hidden = _forward(model)
    stock_logits, _ = _forward(random_qwen(arch, attn="sdpa", layers=3))
    assert not torch.equal(want_logits, stock_logits)  # the alignment is in force, so the check below means it
    got_logits, got_hidden = _forward(torch.compile(model, fullgraph=True, options=EMULATE))
    assert torch.equal(got_logits, want_logits)
    for got, want in zip(got_hidden, want_hidden, strict=True):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)  # the residual stream a user sees, too


def test_default_inductor_moves_stock_and_aligned_alike(arch):
    # Without emulate_precision_casts, Inductor keeps fused bf16 intermediates in fp32: a stock model moves too,
    # so the difference is Inductor's and not the alignment's; both are pinned, so an Inductor change shows here
    torch._dynamo.reset()
    moved = {}
    for variant in ("baseline", "full"):
        model = _model(arch, variant)
        want, _ = _forward(model)
        got, _ = _forward(torch.compile(model, fullgraph=True))
        moved[variant] = float((got != want).float().mean())
        assert torch.allclose(got.float(), want.float(), rtol=0.05, atol=0.15)  # a few bf16 ulps of the logits
    assert moved["baseline"] > 0.3 and moved["full"] > 0.3, moved


def test_compiling_an_aligned_model_without_emulated_casts_warns_once(monkeypatch):
    # Inductor's default drops the aligned regions' bf16 roundings (above): a user who compiles an aligned model
    # that way is told, once; with the option, another backend, or a stock model, nothing is said
    def warnings_of(model, **compile_kwargs):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _forward(torch.compile(model, **compile_kwargs), hidden=False)
        return [str(w.message) for w in caught if "emulate_precision_casts" in str(w.message)]

    monkeypatch.setattr(patch, "_warned_compile_options", False)
    model = _model("qwen3")
    assert warnings_of(model, options=EMULATE) == []
    assert warnings_of(model, backend="aot_eager") == []
    assert warnings_of(random_qwen("qwen3", attn="sdpa", layers=1)) == []  # stock: no aligned forward traced
    # Inductor's global setting counts as the option (only an unset option falls back to it)
    with torch._inductor.config.patch(emulate_precision_casts=True):  # (monkeypatch would delete the setting)
        assert warnings_of(model) == []
    first = warnings_of(model)
    assert first == [
        "an aligned roundalign model is being compiled by Inductor without emulate_precision_casts: Inductor fuses the "
        "aligned regions and drops the bf16 roundings they keep, so the model no longer rounds where the engine does. "
        'Compile it with torch.compile(model, options={"emulate_precision_casts": True}) (docs/numerics.md).']
    assert warnings_of(model) == []  # once per process


def test_compiled_model_does_not_recompile_on_a_repeated_call():
    # the carrier slot is emptied by the final norm: the next call sees the same (empty) state, no new guards fail.
    # Compiled before any eager call, so without output_hidden_states: transformers 5.17's output capture takes
    # a lock on a model's first call that Dynamo cannot enter, a stock model's limit as well.
    torch._dynamo.reset()
    cm = torch.compile(_model("qwen2"), fullgraph=True, options=EMULATE)
    first, _ = _forward(cm, hidden=False)
    with torch.compiler.set_stance("fail_on_recompile"):
        again, _ = _forward(cm, hidden=False)
    assert torch.equal(first, again)


@pytest.mark.parametrize("arch,engine,kernels", [("qwen2", *TARGETS[0]), ("qwen3", *TARGETS[1])])
def test_training_through_the_compiled_aligned_model(arch, engine, kernels):
    # Forward bitwise (the loss is a function of the logits, and cross entropy is outside the regions: compared
    # with stock's own compiled-vs-eager loss); gradients through AOTAutograd + Inductor's backward differ from
    # eager autograd in stock and aligned models alike (reduction orders), so they are held to bf16 closeness
    # against the eager aligned gradients, no looser than stock's compiled-vs-eager gradients are.
    torch._dynamo.reset()

    def loss_and_grads(model, compiled):
        run = torch.compile(model, fullgraph=True, options=EMULATE) if compiled else model
        model.zero_grad(set_to_none=True)
        loss = run(input_ids=IDS, labels=IDS).loss
        loss.backward()
        return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()}

    rel = {}
    for variant in ("baseline", "full"):
        model = _model(arch, variant, engine, kernels).train()
        l_eager, g_eager = loss_and_grads(copy.deepcopy(model), compiled=False)
        l_comp, g_comp = loss_and_grads(model, compiled=True)
        assert torch.allclose(l_comp, l_eager, rtol=1e-6, atol=0)
        assert set(g_comp) == set(g_eager)
        rel[variant] = max(float((g_comp[n] - g_eager[n]).norm() / g_eager[n].norm()) for n in g_eager)
    assert rel["full"] < 0.02, rel  # bf16 gradients: a few ulps of the largest entries, not a broken backward
    assert rel["full"] <= 2 * rel["baseline"] + 1e-3, rel


def test_trls_torch_compile_path_trains_the_aligned_policy_compiled(tmp_path, monkeypatch):
    # GRPOConfig(torch_compile=True): accelerate compiles the policy in prepare(); the runner hands it
    # emulate_precision_casts. Step 1 starts from identical weights and rollouts, so its loss (a function of the
    # compiled forward) equals the eager run's exactly; its gradient comes from Inductor's backward (close, not
    # equal), and later steps drift apart by that.
    # warm-started, so that rewards vary within a group and the loss is not zero
    model = pretrain_tiny(make_tiny("qwen2", tmp_path / "tiny", hidden=64, layers=2, seed=0), tmp_path / "sft",
                          steps=400, log=lambda *_: None)
    run = {"model": str(model), "variant": "full", "steps": 2, "prompts_per_step": 8, "num_generations": 4,
           "per_device_batch_size": 32, "max_completion_length": 6, "learning_rate": 2e-3, "checkpoint_every": 10}
    eager = run_train(build_config(overrides=run), tmp_path / "eager", log=lambda *_: None)

    build, compile_ = train_mod.build_grpo_args, torch.compile
    compiled = []

    def with_compile(*a, **kw):
        args = build(*a, **kw)
        args.torch_compile, args.torch_compile_backend = True, "inductor"
        return args

    def recording_compile(model, **kw):  # what accelerate's prepare() compiles, and with which options
        compiled.append((type(model).__name__, kw.get("options")))
        return compile_(model, **kw)

    monkeypatch.setattr(train_mod, "build_grpo_args", with_compile)
    monkeypatch.setattr(torch, "compile", recording_compile)
    torch._dynamo.reset()
    comp = run_train(build_config(overrides=run), tmp_path / "compiled", log=lambda *_: None)
    assert eager.status == comp.status == "done"
    assert compiled == [("Qwen2ForCausalLM", EMULATE)]
    rows = {k: [json.loads(x) for x in (tmp_path / k / "metrics.jsonl").read_text().splitlines()]
            for k in ("eager", "compiled")}
    e1, c1 = rows["eager"][0], rows["compiled"][0]
    assert e1["optim/loss"] != 0 and c1["optim/loss"] == e1["optim/loss"]
    assert e1["optim/grad_norm"] > 0
    assert c1["optim/grad_norm"] == pytest.approx(e1["optim/grad_norm"], rel=0.02)
    print("torch_compile step 1 (eager, compiled):",
          {k: (e1[k], c1[k]) for k in ("optim/loss", "optim/grad_norm", "mismatch/token/k3")})
