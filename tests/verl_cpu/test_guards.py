"""Each guard of ``roundalign.integrations.verl`` fires through verl's own code path where one exists (the worker built
from verl's hydra config, ``EngineRegistry.new``), names the setting and the fix; and what the warnings claim is
measured here: sdpa on verl's packed micro-batch moves the actor's log-probs, eager attention or unpacked sdpa do
not."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: tools/envs/verl_env.sh .venv-verl (conftest.py)")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from verl.workers.config import RolloutConfig  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402

from roundalign.integrations import verl as ra_verl  # noqa: E402
from roundalign.models.tiny import make_tiny  # noqa: E402
from roundalign.numerics.patch import apply_alignment  # noqa: E402
from verl_actor import actor_logprobs, hf_logprobs, rollout_batch, worker  # noqa: E402

pytestmark = pytest.mark.usefixtures("process_group")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny("qwen2", tmp_path_factory.mktemp("qwen2"), hidden=64, layers=2, tie=False)


@pytest.mark.parametrize("setting", ["use_liger", "use_fused_kernels"])
def test_kernels_that_replace_aligned_code_are_refused(tiny, setting):
    w = worker(tiny, f"actor_rollout_ref.model.{setting}=True")
    with pytest.raises(ValueError, match=rf"actor_rollout_ref\.model\.{setting}=True: .* Set actor_rollout_ref\.model\."
                                         rf"{setting}=False"):
        w.init_model()


def test_packed_sdpa_moves_logits_and_eager_does_not(tiny):
    """transformers' own forward on verl's packed layout (one row, positions restarting per sequence, no mask)
    against each sequence alone, aligned and stock."""
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 512, (n,), generator=g) for n in (7, 11, 5)]
    ids, pos = torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None]
    for attn in ("sdpa", "eager"):
        for variant in ("baseline", "full"):
            model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16, attn_implementation=attn).eval()
            apply_alignment(model, variant, "vllm-compiled", kernels="eager")
            with torch.no_grad():
                per_seq = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
                packed = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits[0]
            # measured on this model: sdpa up to 7.8e-2 (baseline) and 6.2e-2 (full) apart
            assert torch.equal(packed, per_seq) == (attn == "eager"), (attn, variant)


def test_remove_padding_under_sdpa_warns_and_costs_bitwise_scoring(tiny):
    td = rollout_batch(vocab=512, seed=1)
    mask = td["response_mask"].bool()
    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    apply_alignment(reference, "full", "vllm-compiled", kernels="eager")
    expected = hf_logprobs(reference, td)

    packed = worker(tiny, "actor_rollout_ref.model.override_config.attn_implementation=sdpa")
    with pytest.warns(UserWarning, match=r"use_remove_padding=True with attn_implementation='sdpa'.*"
                                         r"attn_implementation=eager"):
        packed.init_model()
    assert not torch.equal(actor_logprobs(packed, td)[mask], expected[mask])  # measured: up to 6.5e-2 nats apart

    unpacked = worker(tiny, "actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                      "actor_rollout_ref.model.use_remove_padding=False")
    unpacked.init_model()  # no warning: pytest's filterwarnings would not fail on one, so check the fix instead
    assert torch.equal(actor_logprobs(unpacked, td)[mask], expected[mask])


def test_what_verl_cannot_run_on_cpu_is_refused_with_the_fix(tiny):
    fsdp1 = worker(tiny, "actor_rollout_ref.actor.strategy=fsdp")
    with pytest.raises(ValueError, match=r"strategy=fsdp \(FSDP1\) cannot run on a CPU.*strategy=fsdp2"):
        fsdp1.init_model()
    reference = worker(tiny, role="ref")
    with pytest.raises(ValueError, match=r"reference.*pinned memory.*use_kl_loss=False"):
        reference.init_model()
    rollout = worker(tiny, "actor_rollout_ref.rollout.name=vllm", role="rollout")
    with pytest.raises(ValueError, match=r"verl's rollout runs its inference server .*\(role='actor'\)"):
        rollout.init_model()


def test_engines_other_than_fsdp_are_refused_for_an_aligned_model():
    ours = SimpleNamespace(external_lib=ra_verl.__name__)
    with pytest.raises(ValueError, match=r"strategy='megatron': .* aligns verl's FSDP engine only"):
        EngineRegistry.new(model_type="language_model", backend="megatron", model_config=ours)
    # a model that does not name the module reaches verl's own lookup (megatron is not installed here)
    with pytest.raises(AssertionError, match="Unknown backend"):
        EngineRegistry.new(model_type="language_model", backend="megatron", model_config=SimpleNamespace())


def _rollout(**kw):
    return RolloutConfig(**{"name": "vllm", **kw})


def test_rollout_settings_that_contradict_the_alignment(recwarn):
    compiled = ra_verl.VerlSettings(engine="vllm-compiled")
    ra_verl.check_rollout(_rollout(), compiled, "cuda")  # verl's defaults: vLLM, compiled, processed logprobs
    ra_verl.check_rollout(_rollout(enforce_eager=True), ra_verl.VerlSettings(engine="vllm-eager"), "cuda")
    assert not [w for w in recwarn if "actor_rollout_ref" in str(w.message)]
    with pytest.raises(ValueError, match=r"rollout\.name='sglang'.*set actor_rollout_ref\.rollout\.name=vllm"):
        ra_verl.check_rollout(_rollout(name="sglang"), compiled, "cuda")
    with pytest.raises(ValueError, match=r"enforce_eager=True runs vLLM eagerly.*ROUNDALIGN_ENGINE=vllm-eager"):
        ra_verl.check_rollout(_rollout(enforce_eager=True), compiled, "cuda")
    with pytest.raises(ValueError, match=r"ROUNDALIGN_ENGINE='vllm-cpu-compiled' is a map of vLLM's CPU build"):
        ra_verl.check_rollout(_rollout(), ra_verl.VerlSettings(engine="vllm-cpu-compiled"), "cuda")
    with pytest.warns(UserWarning, match=r"top_k=-1, top_p=0\.9.*truncated"):
        ra_verl.check_rollout(_rollout(top_p=0.9), compiled, "cuda")
    with pytest.warns(UserWarning, match=r"logprobs_mode='raw_logprobs'.*processed_logprobs"):
        ra_verl.check_rollout(_rollout(logprobs_mode="raw_logprobs"), compiled, "cuda")


def test_bad_settings_name_the_variable_and_the_choices():
    assert ra_verl.VerlSettings.from_env({}) == ra_verl.VerlSettings("full", "vllm-compiled", None)
    assert ra_verl.VerlSettings.from_env({}).region_kernels == "eager"
    assert ra_verl.VerlSettings.from_env({"ROUNDALIGN_ENGINE": "vllm-cpu-compiled"}).region_kernels == "compiled"
    for key, value, choice in (("ROUNDALIGN_VARIANT", "fulll", "baseline, rope, swiglu, norm, full"),
                               ("ROUNDALIGN_ENGINE", "vllm", "vllm-compiled"),
                               ("ROUNDALIGN_KERNELS", "fused", "eager, compiled")):
        with pytest.raises(ValueError, match=rf"{key}='{value}': expected one of .*{choice}"):
            ra_verl.VerlSettings.from_env({key: value})


def _python(code):
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)


def test_another_verl_release_is_refused_and_no_verl_imports():
    other = _python("import verl; verl.__version__ = '0.9.2'\nimport roundalign.integrations.verl")
    assert other.returncode != 0
    assert other.stderr.strip().splitlines()[-1] == (
        "ImportError: roundalign.integrations.verl wraps verl 0.9.1's internals; this environment has verl 0.9.2: "
        "install verl==0.9.1 (tools/envs/verl_env.sh builds an environment with it (docs/verl.md))")
    # without verl (as in the main environment) the module imports; only installing the hooks refuses
    absent = _python("import sys; sys.modules['verl'] = None\nimport roundalign.integrations.verl as m\n"
                     "print(m.rollout_corr_metrics.__name__)\nm.install()")
    assert absent.stdout.strip() == "rollout_corr_metrics"
    assert "ImportError: roundalign.integrations.verl needs verl==0.9.1, which is not importable here" in absent.stderr
