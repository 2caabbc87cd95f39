"""Guards on the TRL internals roundalign bridges to (trl==1.16.0). A failure here means TRL changed a
private surface: re-read the named TRL code and port roundalign/training/trl_bridge.py before updating the pin."""

import inspect

import torch
import trl
from transformers import Trainer
from trl import GRPOTrainer
from trl.generation import vllm_generation
from trl.trainer import utils as trl_utils

from roundalign.training.trl_bridge import TRL_RENAMES, _is_stats


def src(obj) -> str:
    return inspect.getsource(obj)


def test_pinned_trl():
    assert trl.__version__ == "1.16.0"


def test_weight_sync_hook_used_by_bridge_emulated_engine():
    # TRL re-syncs "vLLM" weights through vllm_generation.sync_weights() when global_step moved
    body = src(GRPOTrainer._generate)
    assert "self.rollout_func(prompts, self)" in body
    assert "self.use_vllm and self.state.global_step != self._last_loaded_step" in body
    assert "self.vllm_generation.sync_weights()" in body


def test_importance_sampling_path_is_gated_on_use_vllm():
    body = src(GRPOTrainer._generate_and_score_completions)
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in body
    assert 'output["sampling_per_token_logps"] = sampling_per_token_logps' in body
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
        assert f'"{key}": {key},' in body, key
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        assert mode in body


def test_logprob_helper_signature():
    params = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    for name in ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"):
        assert name in params, name


def test_fused_lm_head_reads_the_backbone_and_lm_head_weight():
    # alignment must act on decoder modules: TRL's logprob path calls the backbone, then lm_head.weight
    body = src(trl_utils.add_fused_lm_head)
    assert "backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)" in body
    assert "weight, bias = lm_head.weight, lm_head.bias" in body


def test_colocated_llm_is_built_from_the_module_level_name():
    assert "self.llm = LLM(" in src(vllm_generation)
    assert 'logprobs_mode="processed_logprobs"' in src(vllm_generation)


def test_renamed_metrics_still_exist_in_trl():
    body = src(GRPOTrainer)
    for trl_name in TRL_RENAMES:
        if trl_name in ("loss", "grad_norm", "learning_rate"):
            continue  # logged by transformers' Trainer, not GRPOTrainer
        assert f'"{trl_name}"' in body, trl_name


def test_is_stats_matches_trl_bounds():
    delta = torch.log(torch.tensor([[4.0, 1.0, 0.5], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    # token_truncate, cap 3: of 5 tokens only ratio 4 exceeds the cap
    assert _is_stats(delta, mask, "token_truncate", 3.0, None) == {"is/clipped_frac": 0.2}
    # sequence_mask, [1/3, 3]: sequence ratios 4*1*0.5 = 2 and 1: none outside
    assert _is_stats(delta, mask, "sequence_mask", 3.0, 1 / 3) == {"is/masked_frac": 0.0}
    # sequence_mask with cap 1.5: sequence 0 (ratio 2) is masked
    assert _is_stats(delta, mask, "sequence_mask", 1.5, 1 / 1.5) == {"is/masked_frac": 0.5}


def test_logprob_helper_scores_without_position_ids_through_a_module_call():
    # our pre-hook supplies position_ids; it fires only because TRL calls the model module (not .forward)
    body = src(GRPOTrainer._get_per_token_logps_and_entropies)
    assert "outputs = model(**model_inputs, labels=labels, fused_lm_head=True)" in body
    assert '["position_ids"]' not in body and " position_ids=" not in body  # (image_position_ids is VLM-only)


def test_trainer_hooks_used_by_fp32_master_weights():
    loop = src(Trainer._run_epoch)
    assert "grad_norm = self._clip_grad_norm(model)" in loop and "self.optimizer.step()" in loop
    assert "self.create_optimizer()" in src(Trainer._prepare_for_training)
    assert "return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)" in src(
        Trainer._clip_grad_norm)
    assert "return self._compute_loss(model, inputs)" in src(GRPOTrainer.compute_loss)


def test_the_fused_head_that_engine_scoring_replaces():
    # add_engine_scored_lm_head (scoring=engine) replaces the instance forward add_fused_lm_head installs and returns
    # what it returns: the calling convention, the output's fields, and where GRPOTrainer installs it
    body = src(trl_utils.add_fused_lm_head)
    assert "model.forward = types.MethodType(_fused_forward, model)" in body
    assert "@functools.wraps(type(model).forward)" in body
    assert "self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs" in body
    assert "hidden_states = backbone_outputs.last_hidden_state[:, :-1]" in body and "labels = labels[:, 1:]" in body
    fields = set(trl_utils.FusedCausalLMOutput.__dataclass_fields__)
    assert {"loss", "log_probs", "entropy", "label_mask"} <= fields
    init = src(GRPOTrainer.__init__)
    assert 'outputs=("log_probs", "entropy"),' in init
    assert "add_fused_lm_head(\n                self.ref_model, temperature=self.temperature" in init
    # every TRL read of the head's output that the engine-scored head fills
    uses = src(GRPOTrainer)
    for read in ("outputs.log_probs[:, -logits_to_keep:]", "outputs.entropy[:, -logits_to_keep:]"):
        assert read in uses, read
