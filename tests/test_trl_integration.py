"""``roundalign.integrations.trl.on_policy_grpo``'s guards and hooks on TRL 1.16's own GRPOTrainer, without vLLM (the
end-to-end runs against vLLM's CPU build are tests/vllm_cpu/test_trl_example.py).

- every GRPOConfig setting that would undo the alignment is refused before anything is built or changed, naming the
  setting and its fix, all of them in one message;
- the names (engine, variant, attention, scoring, dtype, trainer class) are checked against their choices;
- a model saved aligned and reloaded with a plain ``from_pretrained`` is refused, one reloaded with roundalign's
  loader passes; a model aligned to another target is refused;
- ``torch_compile=True``: accelerate compiles the policy and TRL's reference model with ``emulate_precision_casts``
  (read back from the compiled modules accelerate makes), which they lack without the call;
- the positions hook installed on a stock trainer instance scores a left-padded sequence as the same sequence
  unpadded, which TRL's own scoring does not;
- a trainer class that replaces the policy it was given is refused after it is built.
"""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from roundalign.integrations import trl as integration
from roundalign.integrations.trl import on_policy_grpo
from roundalign.models.load import load_model, load_tokenizer
from roundalign.models.tiny import make_tiny
from roundalign.numerics.patch import alignment_of, apply_alignment
from roundalign.training.trl_bridge import RoundalignGRPOTrainer, install_on_instance, keep_precision_casts

ENGINE = "vllm-cpu-compiled"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # head_dim 32: one of vLLM-CPU's attention head sizes, so that only the setting under test is refused
    return make_tiny("qwen2", tmp_path_factory.mktemp("m") / "tiny", hidden=128, heads=4, layers=1, seed=0)


DEFAULT = object()  # a setting left out: GRPOConfig's default


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate", bf16=False, use_cpu=True,
                report_to="none", per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    return GRPOConfig(**{k: v for k, v in {**base, **kw}.items() if v is not DEFAULT})


def _reward(completions, **_):
    return [float(len(c)) for c in completions]


def _trainer_kwargs(tiny):
    return dict(reward_funcs=_reward, train_dataset=Dataset.from_list([{"prompt": "What is 1+1?"}] * 8),
                processing_class=load_tokenizer(str(tiny)))


OFFENDING = [  # (GRPOConfig settings, what the message must name, the fix it must give)
    ({"use_liger_kernel": True}, "use_liger_kernel=True: Liger's kernels replace the SwiGLU MLP, the RMSNorms and "
                                 "apply_rotary_pos_emb", "set use_liger_kernel=False"),
    ({"model_init_kwargs": {"use_kernels": True}}, "model_init_kwargs={'use_kernels': True}: Hub kernels replace the "
                                                   "aligned layers", "drop use_kernels"),
    ({"bf16": DEFAULT}, "bf16=True (GRPOConfig's default is bf16=True)", "set bf16=False and fp16=False"),
    ({"cast_lm_head_to_fp32": True}, "cast_lm_head_to_fp32=True", "set cast_lm_head_to_fp32=False"),
    ({"top_k": 50}, "top_k=50: the engine would sample from", "set top_k=0"),
    ({"generation_kwargs": {"top_p": 0.9}}, "generation_kwargs sets top_p", "drop them"),
    ({"vllm_model_impl": "transformers"}, "vllm_model_impl='transformers'", "set vllm_model_impl='vllm'"),
    ({"use_vllm": False}, "use_vllm=False", "set use_vllm=True"),
    ({"vllm_mode": "server"}, "vllm_mode='server': vLLM-CPU runs colocated only", "set vllm_mode='colocate'"),
    ({"torch_compile": True}, "torch_compile=True with attn='vllm_cpu'", "set torch_compile=False, or attn='sdpa'"),
]


@pytest.mark.parametrize("settings,named,fix", OFFENDING, ids=[next(iter(o[0])) for o in OFFENDING])
def test_a_setting_that_undoes_the_alignment_is_refused_by_name_before_anything_changes(tiny, tmp_path, settings,
                                                                                        named, fix):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
    args = _args(tmp_path, **settings)
    with pytest.raises(ValueError) as err:
        on_policy_grpo(GRPOTrainer, engine=ENGINE, model=model, args=args, **_trainer_kwargs(tiny))
    assert named in str(err.value) and fix in str(err.value), str(err.value)
    assert str(err.value).count("\n  - ") == 1, str(err.value)  # only the setting under test
    # refused before the model was touched: still stock numerics, stock attention, no recorded alignment
    assert alignment_of(model)[0] == "baseline" and getattr(model.config, "roundalign", None) is None
    assert model.config._attn_implementation != "vllm_cpu"


def test_a_cpu_only_trainer_is_refused_against_a_gpu_engine(tiny, tmp_path):
    with pytest.raises(ValueError) as err:
        on_policy_grpo(GRPOTrainer, engine="vllm-compiled", model=str(tiny), args=_args(tmp_path),
                       **_trainer_kwargs(tiny))
    assert "use_cpu=True: 'vllm-compiled' is a GPU engine; set use_cpu=False" in str(err.value), str(err.value)


def test_every_offending_setting_is_named_in_one_message(tiny, tmp_path):
    args = _args(tmp_path, use_liger_kernel=True, top_p=0.9, cast_lm_head_to_fp32=True)
    with pytest.raises(ValueError) as err:
        on_policy_grpo(GRPOTrainer, engine=ENGINE, model=str(tiny), args=args, **_trainer_kwargs(tiny))
    lines = str(err.value).splitlines()
    assert lines[0] == f"GRPOConfig settings that would take the trainer off-policy against {ENGINE!r}:"
    assert [line.split(":")[0] for line in lines[1:]] == ["  - use_liger_kernel=True", "  - cast_lm_head_to_fp32=True",
                                                          "  - top_p=0.9"]


@pytest.mark.parametrize("kw,error,message", [
    ({"engine": "vllm-cpu"}, ValueError, "unknown engine 'vllm-cpu'; valid engines: vllm-compiled, vllm-eager, "
                                         "vllm-cpu-compiled, vllm-cpu-eager"),
    ({"variant": "tis"}, ValueError, "variant='tis'; valid variants: baseline, rope, swiglu, norm, full"),
    ({"scoring": "vllm"}, ValueError, "scoring='vllm'; valid choices: trl, engine"),
    ({"attn": "flash"}, ValueError, "attn='flash'; valid choices: None (the engine's own kernel), eager, sdpa, "
                                    "vllm_cpu, vllm_flash"),
    ({"attn": "vllm_flash"}, ValueError, "attn='vllm_flash' reproduces the eager GPU engine's FlashAttention call; "
                                         f"engine {ENGINE!r} is not vllm-eager"),
    ({"engine": "vllm-compiled", "attn": "vllm_cpu"}, ValueError, "attn='vllm_cpu' is vLLM-CPU's attention kernel; "
                                                                  "engine 'vllm-compiled' runs on a GPU"),
    ({"dtype": "bfloat16"}, ValueError, "dtype='bfloat16'; valid choices: bf16, fp16, fp32"),
    ({"trainer_cls": object}, TypeError, "expected trl.GRPOTrainer or a subclass of it"),
    ({"trainer_cls": RoundalignGRPOTrainer}, TypeError, "RoundalignGRPOTrainer scores this way already"),
])
def test_names_are_checked_against_their_choices(tiny, tmp_path, kw, error, message):
    call = {"trainer_cls": GRPOTrainer, "engine": ENGINE, **kw}
    with pytest.raises(error) as err:
        on_policy_grpo(call.pop("trainer_cls"), model=str(tiny), args=_args(tmp_path), **call, **_trainer_kwargs(tiny))
    assert message in str(err.value), str(err.value)


def test_a_model_reloaded_without_its_recorded_alignment_is_refused(tmp_path):
    # head_dim 16: a model that passes the alignment checks then stops at the head-size check, before any vLLM
    saved = tmp_path / "aligned"
    model = load_model(str(make_tiny("qwen2", tmp_path / "tiny", hidden=64, heads=4, layers=1, seed=0)))
    apply_alignment(model, "full", ENGINE)
    model.save_pretrained(saved)
    args, kw = _args(tmp_path), _trainer_kwargs(tmp_path / "tiny")

    plain = AutoModelForCausalLM.from_pretrained(saved)  # config.json records the alignment, the model has none
    assert plain.config.roundalign["variant"] == "full" and alignment_of(plain)[0] == "baseline"
    with pytest.raises(ValueError) as err:
        on_policy_grpo(GRPOTrainer, engine=ENGINE, model=plain, args=args, **kw)
    msg = str(err.value)
    assert f"its config records the alignment variant=full engine={ENGINE}, but the model runs stock numerics" in msg
    assert "load it with roundalign.models.load.load_model" in msg, msg

    reloaded = load_model(str(saved))  # re-applies the recorded alignment: the model check passes
    with pytest.raises(ValueError, match="head_dim=16 is not one of vLLM-CPU's attention head sizes"):
        on_policy_grpo(GRPOTrainer, engine=ENGINE, model=reloaded, args=args, **kw)

    with pytest.raises(ValueError) as err:  # aligned, but to another engine than the one asked for
        on_policy_grpo(GRPOTrainer, engine="vllm-cpu-eager", model=reloaded, args=args, **kw)
    assert (f"model is aligned as variant=full engine={ENGINE}, but variant='full' engine='vllm-cpu-eager' was asked "
            "for") in str(err.value)


def test_torch_compile_compiles_policy_and_reference_with_emulate_precision_casts(tiny, tmp_path):
    # TRL's own trainer (use_vllm off: nothing of vLLM is needed to build it); beta > 0 loads a reference model,
    # which GRPOTrainer.__init__ compiles at once
    args = _args(tmp_path, use_vllm=False, torch_compile=True, beta=0.04)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16)
    trainer = GRPOTrainer(model=model, args=args, **_trainer_kwargs(tiny))

    def casts(compiled):  # the Inductor options accelerate's torch.compile call gave this module
        return compiled.get_compiler_config()["emulate_precision_casts"]

    assert casts(trainer.ref_model) is False  # Inductor's default: it would drop the aligned regions' roundings
    assert keep_precision_casts(trainer) is True
    assert casts(trainer.ref_model) is True
    assert casts(trainer.accelerator.prepare_model(trainer.model)) is True  # as Trainer.train() prepares the policy
    assert keep_precision_casts(GRPOTrainer(model=model, args=_args(tmp_path, use_vllm=False),
                                            **_trainer_kwargs(tiny))) is False


def test_positions_hook_scores_a_left_padded_sequence_as_unpadded(tiny, tmp_path):
    # bf16 with eager attention: a padded key costs no rounding there, so the position ids are the only difference
    # left between a left-padded row and the same sequence alone (as vLLM runs it, from position 0). RoPE is
    # shift-invariant in exact arithmetic; TRL's arange positions move the bf16 roundings of the rotated q and k
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16, attn_implementation="eager")
    trainer = GRPOTrainer(model=model, args=_args(tmp_path, use_vllm=False), **_trainer_kwargs(tiny))
    g = torch.Generator().manual_seed(0)
    keep = 6  # the completion: the last 6 tokens

    def score(ids, attention_mask):
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(model, ids, attention_mask, keep)[0]

    rows = []
    for pad in (1, 5, 40):  # TRL left-pads the shorter prompts of a batch
        seq = torch.randint(0, 400, (1, 12), generator=g)
        padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), seq], dim=1)
        mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(seq)], dim=1)
        rows.append((score(seq, torch.ones_like(seq)), score(padded, mask), padded, mask))
    install_on_instance(trainer)
    for alone, stock, padded, mask in rows:
        assert torch.equal(score(padded, mask), alone)
        assert (stock - alone).abs().max() > 1e-3, (stock - alone).abs().max()  # measured 0.03-0.04 nats
    with pytest.raises(RuntimeError, match="installed on this trainer already"):
        install_on_instance(trainer)


class _ReplacesThePolicy(GRPOTrainer):
    def __init__(self, *, model, **kw):
        super().__init__(model=model, **kw)
        self.model = AutoModelForCausalLM.from_pretrained(model.name_or_path, dtype=torch.bfloat16)


def test_a_trainer_that_replaces_the_policy_it_was_given_is_refused(tiny, tmp_path):
    model = apply_alignment(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16), "full", ENGINE)
    trainer = _ReplacesThePolicy(model=model, args=_args(tmp_path, use_vllm=False), **_trainer_kwargs(tiny))
    with pytest.raises(RuntimeError) as err:  # the first check on the built trainer, before any engine is read
        integration._make_on_policy(trainer, ENGINE, "full", "engine", log=print)
    assert ("_ReplacesThePolicy trains a policy aligned as ('baseline', 'vllm-compiled'), not ('full', "
            f"'{ENGINE}'): the trainer replaced the model it was given") in str(err.value)
