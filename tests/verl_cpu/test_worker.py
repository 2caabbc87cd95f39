"""verl 0.9.1's own actor, built from verl's own hydra config with
``actor_rollout_ref.model.external_lib=roundalign.integrations.verl``, scores every response token as an aligned bf16
Hugging Face model scored with vLLM's sampler formula does, bit for bit; without the external_lib it does not; and
``update_actor`` (verl's ``ppo_loss``) trains it.

The worker is ``ActorRolloutRefWorker(role="actor")`` with no Ray: FSDP2 on one gloo rank, the CPU platform of
``cpu_platform.py``, eager attention (on packed sequences eager is bitwise the per-sequence forward; sdpa is not,
``test_guards.py``), verl's defaults elsewhere (``use_remove_padding``, gradient checkpointing, bf16 mixed
precision). The batch is laid out as verl's trainer hands it over (``RayPPOTrainer._compute_old_log_prob``):
left-padded prompts, right-padded responses, then ``left_right_2_no_padding``. The worker, the batches and the
reference live in ``verl_actor.py``, which ``tools/gpu_check.py`` part (h) runs on a GPU too.
"""

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: tools/envs/verl_env.sh .venv-verl (conftest.py)")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl_actor import actor_logprobs, hf_logprobs, ppo_batch, rollout_batch, worker  # noqa: E402

from roundalign.models.tiny import make_tiny  # noqa: E402
from roundalign.numerics.patch import alignment_of, apply_alignment  # noqa: E402

pytestmark = pytest.mark.usefixtures("process_group")


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    # untied: verl builds an untied model under meta-device init (get_init_weight_context_manager), as for real ones
    return make_tiny(request.param, tmp_path_factory.mktemp(request.param), hidden=64, layers=2, tie=False)


def test_actor_scores_as_the_aligned_engine_formula_bitwise_and_trains(tiny, monkeypatch):
    td = rollout_batch(vocab=512, seed=1)
    mask = td["response_mask"].bool()

    aligned = worker(tiny)
    aligned.init_model()
    inner = aligned.actor.engine.module
    assert alignment_of(inner) == ("full", "vllm-compiled", "eager")
    lp = actor_logprobs(aligned, td)

    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16, attn_implementation="eager").eval()
    stock_ref = hf_logprobs(reference, td)
    apply_alignment(reference, "full", "vllm-compiled", kernels="eager")
    aligned_ref = hf_logprobs(reference, td)
    assert not torch.equal(aligned_ref[mask], stock_ref[mask])  # the alignment moves these tokens' log-probs
    diff = (lp - aligned_ref)[mask].abs().max().item()
    assert torch.equal(lp[mask], aligned_ref[mask]), f"max |verl - aligned HF| = {diff:.3e}"

    stock = worker(tiny, external_lib=None)
    stock.init_model()
    assert alignment_of(stock.actor.engine.module)[0] == "baseline"
    stock_lp = actor_logprobs(stock, td)
    assert not torch.equal(stock_lp[mask], lp[mask])

    # flash-attn's cross-entropy reported available (a GPU machine with flash-attn): verl's own path goes there (and
    # fails here, where flash_attn is not installed); the aligned actor never reaches it
    with monkeypatch.context() as m:
        m.setattr(verl_F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", True)
        with pytest.raises(NameError, match="cross_entropy_loss"):
            actor_logprobs(stock, td)
        assert torch.equal(actor_logprobs(aligned, td)[mask], lp[mask])

    # one PPO step with verl's own loss, data laid out as RayPPOTrainer._update_actor lays it out
    data = ppo_batch(aligned, vocab=512, seed=2)
    before = {n: p.full_tensor().clone() for n, p in inner.named_parameters()}
    metrics = aligned.update_actor(data)["metrics"]
    after = {n: p.full_tensor() for n, p in inner.named_parameters()}
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) == len(before), f"unchanged: {sorted(set(before) - set(moved))}"
    assert alignment_of(inner)[0] == "full"  # FSDP's wrapping and the step keep the alignment
    assert not torch.equal(actor_logprobs(aligned, td)[mask], lp[mask])
    assert all(torch.isfinite(torch.as_tensor(v, dtype=torch.float64)).all() for v in metrics.values()
               if isinstance(v, (int, float, list, torch.Tensor)))
