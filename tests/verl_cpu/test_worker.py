"""verl 0.9.1's own actor, built from verl's own hydra config with
``actor_rollout_ref.model.external_lib=roundalign.integrations.verl``, scores every response token as an aligned bf16
Hugging Face model scored with vLLM's sampler formula does, bit for bit; without the external_lib it does not; and
``update_actor`` (verl's ``ppo_loss``) trains it.

The worker is ``ActorRolloutRefWorker(role="actor")`` with no Ray: FSDP2 on one gloo rank, the CPU platform of
``cpu_platform.py``, eager attention (on packed sequences eager is bitwise the per-sequence forward; sdpa is not,
``test_guards.py``), verl's defaults elsewhere (``use_remove_padding``, gradient checkpointing, bf16 mixed
precision). The batch is laid out as verl's trainer hands it over (``RayPPOTrainer._compute_old_log_prob``):
left-padded prompts, right-padded responses, then ``left_right_2_no_padding``.
"""

import os

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: tools/envs/verl_env.sh .venv-verl (conftest.py)")

import torch  # noqa: E402
import verl  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.engine_workers import ActorRolloutRefWorker  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

from roundalign.integrations import verl as ra_verl  # noqa: E402
from roundalign.models.tiny import make_tiny  # noqa: E402
from roundalign.numerics.patch import alignment_of, apply_alignment  # noqa: E402
from roundalign.numerics.sampler import engine_logprobs_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("process_group")

TEMPERATURE = 0.7  # not 1: the engine divides the fp32 logits by T, verl's stock path the bf16 ones
BATCH, PROMPT_LEN, RESPONSE_LEN = 4, 6, 5


def worker(path, *overrides, external_lib=ra_verl.__name__, role="actor"):
    """verl's ``ActorRolloutRefWorker`` from its own ``ppo_trainer`` hydra config, sized for a tiny model on CPU."""
    cfg_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=cfg_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={path}",
            f"actor_rollout_ref.model.external_lib={external_lib or 'null'}",
            "+actor_rollout_ref.model.override_config.attn_implementation=eager",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.ref.strategy=fsdp2",
            "actor_rollout_ref.actor.use_torch_compile=False",  # compiles only verl's entropy; 16 s on 2 cores
            f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.n=1",
            *overrides,
        ])
    return ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role=role)


def rollout_batch(vocab, seed):
    """What verl's trainer holds after a rollout: left-padded prompts, right-padded responses (row i has i pad
    tokens on each side, row 0 none)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(3, vocab, (BATCH, PROMPT_LEN), generator=g)
    responses = torch.randint(3, vocab, (BATCH, RESPONSE_LEN), generator=g)
    pmask = torch.ones(BATCH, PROMPT_LEN, dtype=torch.long)
    rmask = torch.ones(BATCH, RESPONSE_LEN, dtype=torch.long)
    for i in range(1, BATCH):
        pmask[i, :i] = 0
        rmask[i, RESPONSE_LEN - i:] = 0
    prompts[pmask == 0] = 0
    responses[rmask == 0] = 0
    attn = torch.cat([pmask, rmask], 1)
    return TensorDict({"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                       "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
                       "response_mask": rmask}, batch_size=[BATCH])


def score_input(td):
    """``td`` as ``RayPPOTrainer._compute_old_log_prob`` hands it to ``compute_log_prob``."""
    data = left_right_2_no_padding(td.clone())
    tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, temperature=TEMPERATURE,
                         global_token_num=td["attention_mask"].sum(-1).tolist())
    return data


def actor_logprobs(w, td):
    data = score_input(td)
    return no_padding_2_padding(w.compute_log_prob(data)["log_probs"], data)  # (B, RESPONSE_LEN)


def hf_logprobs(model, td):
    """Each sequence alone through a plain HF model, its response tokens scored by vLLM's sampler formula
    (``engine_logprobs_reference``: fp32 upcast, / T, fp32 log-softmax)."""
    out = torch.zeros(BATCH, RESPONSE_LEN)
    with torch.no_grad():
        for i in range(BATCH):
            ids = td["input_ids"][i][td["attention_mask"][i].bool()]
            hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            lp = engine_logprobs_reference(hidden[:-1], model.lm_head.weight, None, ids[1:], TEMPERATURE)
            n_prompt, n_resp = int(td["attention_mask"][i, :PROMPT_LEN].sum()), int(td["response_mask"][i].sum())
            out[i, :n_resp] = lp[n_prompt - 1:n_prompt - 1 + n_resp]
    return out


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
    train = rollout_batch(vocab=512, seed=2)
    train["old_log_probs"] = actor_logprobs(aligned, train)
    g = torch.Generator().manual_seed(3)
    train["advantages"] = torch.randn(train["responses"].shape, generator=g) * train["response_mask"]
    data = left_right_2_no_padding(train)
    tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=BATCH, mini_batch_size=BATCH, epochs=1,
                         seed=42, dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=TEMPERATURE,
                         global_token_num=train["attention_mask"].sum(-1).tolist())
    before = {n: p.full_tensor().clone() for n, p in inner.named_parameters()}
    metrics = aligned.update_actor(data)["metrics"]
    after = {n: p.full_tensor() for n, p in inner.named_parameters()}
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) == len(before), f"unchanged: {sorted(set(before) - set(moved))}"
    assert alignment_of(inner)[0] == "full"  # FSDP's wrapping and the step keep the alignment
    assert not torch.equal(actor_logprobs(aligned, td)[mask], lp[mask])
    assert all(torch.isfinite(torch.as_tensor(v, dtype=torch.float64)).all() for v in metrics.values()
               if isinstance(v, (int, float, list, torch.Tensor)))
