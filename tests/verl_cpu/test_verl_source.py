"""What the hooks rely on in verl 0.9.1's released source, including the GPU-only branches that no CPU run reaches
(flash-attn, the fused kernels, Liger): read from the installed ``verl/workers/engine/fsdp/transformer_impl.py`` and
``verl/workers/engine_workers.py``, so that a verl whose code moved fails here by name.

- Every log-prob and temperature scaling in ``FSDPEngineWithLMHead.prepare_model_outputs`` goes through the two
  module-level names the hooks replace, on every branch (packed, padded; the fused-kernel branch is refused);
  flash-attn's cross-entropy is reached only inside ``logprobs_from_logits``.
- ``_build_module`` loads, patches (Liger, ``apply_monkey_patch``), casts and checkpoints the model and returns it;
  ``_build_model_optimizer`` wraps it in FSDP only afterwards, so the alignment sits under FSDP.
- ``ActorRolloutRefWorker.init_model`` builds the model config (importing ``external_lib``) before the rollout
  config, through the module-level ``omega_conf_to_dataclass`` the rollout hook wraps.
"""

import ast
import inspect
import textwrap

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: tools/envs/verl_env.sh .venv-verl (conftest.py)")

from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers import engine_workers  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl  # noqa: E402

from roundalign.integrations import verl as ra_verl  # noqa: E402


def _method(cls, name):
    """The source of ``cls.name`` as verl ships it (the hooks keep verl's own function in ``_VERL``)."""
    fn = ra_verl._VERL.get(f"{cls.__name__}.{name}", cls.__dict__[name])
    return ast.parse(textwrap.dedent(inspect.getsource(fn)))


def _called(tree):
    """Names called in ``tree``: ``f(...)`` as ``f``, ``m.f(...)`` as ``m.f``, in source order."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name):
                out.append((node.lineno, node.col_offset, f.id))
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                out.append((node.lineno, node.col_offset, f"{f.value.id}.{f.attr}"))
    return [name for *_, name in sorted(out)]


def test_prepare_model_outputs_scores_only_through_the_hooked_names():
    calls = _called(_method(transformer_impl.FSDPEngineWithLMHead, "prepare_model_outputs"))
    assert calls.count("logprobs_from_logits") == 2  # the packed and the padded branch
    assert calls.count("_scale_logits_by_temperature") == 2
    others = [c for c in calls if "logprob" in c.lower() or "cross_entropy" in c or "log_softmax" in c]
    assert others == ["logprobs_from_logits"] * 2, others
    # the module-level names are what the hooks replaced, and verl's own are kept for other engines
    assert transformer_impl.logprobs_from_logits is ra_verl._logprobs_from_logits
    assert ra_verl._VERL["transformer_impl.logprobs_from_logits"] is verl_F.logprobs_from_logits
    assert transformer_impl._scale_logits_by_temperature is ra_verl._scale_logits_by_temperature


def test_flash_attn_cross_entropy_sits_inside_logprobs_from_logits_only():
    src = inspect.getsource(transformer_impl)
    assert "cross_entropy_loss" not in src and "flash_attn.ops" not in src
    assert "logprobs_from_logits_flash_attn" in _called(ast.parse(inspect.getsource(verl_F.logprobs_from_logits)))


def test_the_model_is_aligned_before_fsdp_wraps_it():
    build = _called(_method(transformer_impl.FSDPEngine, "_build_module"))
    order = ["auto_class.from_pretrained", "_apply_liger_kernel_to_instance", "apply_monkey_patch", "module.to",
             "module.gradient_checkpointing_enable"]
    assert [c for c in build if c in order] == order
    outer = _called(_method(transformer_impl.FSDPEngine, "_build_model_optimizer"))
    assert outer.index("self._build_module") < outer.index("self._build_fsdp_module")


def test_the_worker_imports_external_lib_before_it_reads_the_rollout_config():
    tree = _method(engine_workers.ActorRolloutRefWorker, "init_model")
    convs = [ast.unparse(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name) and n.func.id == "omega_conf_to_dataclass"]
    assert convs.index("self.config.model") < convs.index("self.config.rollout")
    assert engine_workers.omega_conf_to_dataclass is ra_verl._omega_conf_to_dataclass
