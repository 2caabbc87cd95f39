"""verl 0.9.1's actor worker, a batch laid out as verl's trainer hands it over, and the reference the actor's
log-probs are held to: shared by ``tests/verl_cpu`` (on a CPU) and part (h) of ``tools/gpu_check.py`` (on a CPU or
one GPU).

- ``worker``: ``ActorRolloutRefWorker`` from verl's own ``ppo_trainer`` hydra config, sized for a tiny model, eager
  attention unless an override names another (the GPU check passes flash_attention_2 or sdpa).
- ``rollout_batch``, ``score_input``, ``actor_logprobs``: left-padded prompts and right-padded responses, then
  ``left_right_2_no_padding``, as ``RayPPOTrainer._compute_old_log_prob`` hands them to ``compute_log_prob``.
- ``ppo_batch``: the same layout with old log-probs and advantages, as ``RayPPOTrainer._update_actor`` hands it to
  ``update_actor``.
- ``hf_logprobs``: each sequence alone through a plain Hugging Face model on its own device, its response tokens
  scored by vLLM's sampler formula.

Importing this module imports verl's engine, and verl fixes its platform then, once per process: without an
accelerator, set ``VERL_PLATFORM=cpu`` and import ``cpu_platform`` first (``conftest.py`` and the GPU check do).
It needs no pytest: the GPU check imports it where pytest may not be installed.
"""

import os

import torch
import verl
from hydra import compose, initialize_config_dir
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from roundalign.integrations import verl as ra_verl
from roundalign.numerics.sampler import engine_logprobs_reference

TEMPERATURE = 0.7  # not 1: the engine divides the fp32 logits by T, verl's stock path the bf16 ones
BATCH, PROMPT_LEN, RESPONSE_LEN = 4, 6, 5


def worker(path, *overrides, external_lib=ra_verl.__name__, role="actor"):
    """verl's ``ActorRolloutRefWorker`` from its own ``ppo_trainer`` hydra config, sized for a tiny model; later
    ``overrides`` win (``actor_rollout_ref.model.override_config.attn_implementation=sdpa`` replaces eager)."""
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
    tokens on each side, row 0 none). CPU tensors, as the trainer holds them; the worker moves them."""
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
    """The worker's ``compute_log_prob`` of ``td``'s response tokens, (BATCH, RESPONSE_LEN) on the CPU."""
    data = score_input(td)
    return no_padding_2_padding(w.compute_log_prob(data)["log_probs"], data)


def ppo_batch(w, vocab, seed):
    """A batch for one PPO step with verl's own loss, laid out as ``RayPPOTrainer._update_actor`` lays it out: old
    log-probs from ``w``, seeded random advantages on the response tokens, one mini-batch of BATCH, one epoch."""
    train = rollout_batch(vocab, seed)
    train["old_log_probs"] = actor_logprobs(w, train)
    g = torch.Generator().manual_seed(seed + 1)
    train["advantages"] = torch.randn(train["responses"].shape, generator=g) * train["response_mask"]
    data = left_right_2_no_padding(train)
    tu.assign_non_tensor(data, calculate_entropy=False, global_batch_size=BATCH, mini_batch_size=BATCH, epochs=1,
                         seed=42, dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=TEMPERATURE,
                         global_token_num=train["attention_mask"].sum(-1).tolist())
    return data


def hf_logprobs(model, td):
    """Each sequence alone (no padding) through a plain HF model on its device, its response tokens scored by vLLM's
    sampler formula (``engine_logprobs_reference``: fp32 upcast, / T, fp32 log-softmax); (BATCH, RESPONSE_LEN) on
    the CPU, 0 at padding."""
    out = torch.zeros(BATCH, RESPONSE_LEN)
    with torch.no_grad():
        for i in range(BATCH):
            ids = td["input_ids"][i][td["attention_mask"][i].bool()].to(model.device)
            hidden = model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            lp = engine_logprobs_reference(hidden[:-1], model.lm_head.weight, None, ids[1:], TEMPERATURE)
            n_prompt, n_resp = int(td["attention_mask"][i, :PROMPT_LEN].sum()), int(td["response_mask"][i].sum())
            out[i, :n_resp] = lp[n_prompt - 1:n_prompt - 1 + n_resp].cpu()
    return out
