"""transformers' common model tests (``ModelTesterMixin``, v5.17.0 sdist) on Qwen2 and Qwen3, once stock and once
per alignment with ``roundalign.apply_alignment`` injected into every model the tests build.

This file is our own: the sdist has ``tests/test_modeling_common.py`` but not the per-model
``tests/models/qwen{2,3}`` files nor ``tests/causal_lm_tester.py``, so ``QwenTester`` below is the smallest model
tester that drives the common mixin (tiny configs, random ids and masks with the mixin's own helpers). It is
not collected by the main suite (no ``test_`` prefix); ``tests/test_hf_model_tests.py`` and
``tools/bench/hf_model_tests.py`` run it in a subprocess with ``hf_common/`` and the sdist's ``hf_tests`` on the path
and compare each aligned class's per-test outcomes with the stock class's.

``ROUNDALIGN_HF_ARCHS`` (``qwen2,qwen3``) and ``ROUNDALIGN_HF_ALIGNMENTS`` (names of ``ALIGNMENTS``, ``stock``
included) choose the classes.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
import unittest

import torch
from hf_tests.generation.test_utils import GenerationTesterMixin  # our empty stand-in (hf_common/sdist.py)
from hf_tests.test_modeling_common import ModelTesterMixin, ids_tensor, random_attention_mask
from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen2ForQuestionAnswering, Qwen2ForSequenceClassification,
                          Qwen2ForTokenClassification, Qwen2Model, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3ForQuestionAnswering, Qwen3ForSequenceClassification, Qwen3ForTokenClassification,
                          Qwen3Model)

from harness import ALIGNMENT_SPECS, CONTROL_SPEC, CONTROLS

from roundalign.numerics import alignment_of, apply_alignment

torch.set_num_threads(1)

# names and specs live in harness.py (light to import, shared with the runner and the record)
ALIGNMENTS = {**ALIGNMENT_SPECS, **{name: CONTROL_SPEC for name in CONTROLS}}
ARCHS = {
    "qwen2": (Qwen2Config, (Qwen2Model, Qwen2ForCausalLM, Qwen2ForSequenceClassification, Qwen2ForTokenClassification,
                            Qwen2ForQuestionAnswering)),
    "qwen3": (Qwen3Config, (Qwen3Model, Qwen3ForCausalLM, Qwen3ForSequenceClassification, Qwen3ForTokenClassification,
                            Qwen3ForQuestionAnswering)),
}

# ---------------------------------------------------------------- the injection
_active: str | None = None  # the ALIGNMENTS name every model built now gets
_depth = threading.local()  # nesting of model constructions: only the outermost model is aligned


def _round_to_bf16(module, args, out):
    return out.to(torch.bfloat16).to(out.dtype) if torch.is_tensor(out) else out


def _wrap_init(cls):
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        depth = getattr(_depth, "n", 0)
        _depth.n = depth + 1
        try:
            orig(self, *args, **kwargs)
        finally:
            _depth.n = depth
        # direct construction, from_pretrained and from_config all end here; unpickling and deepcopy skip
        # __init__ and keep the alignment of what they copy (tests/test_patch.py)
        if depth == 0 and ALIGNMENTS.get(_active) is not None:
            variant, engine, kernels = ALIGNMENTS[_active]
            if _active == "control_rejects_heads" and not type(self).__name__.endswith(("Model", "ForCausalLM")):
                raise TypeError(f"unsupported model class {type(self).__name__} (control_rejects_heads)")
            apply_alignment(self, variant, engine, kernels=kernels)
            for module in self.modules():
                if _active == "control_stale_attn_config" and type(module).__name__.endswith("Attention"):
                    module.config = copy.copy(module.config)
                if _active == "control_bf16_in_fp32" and type(module).__name__.endswith("DecoderLayer"):
                    module.register_forward_hook(_round_to_bf16)

    cls.__init__ = __init__


for _config, _classes in ARCHS.values():
    for _cls in _classes:
        _wrap_init(_cls)


# ---------------------------------------------------------------- our model tester
class QwenTester:
    """The attributes ModelTesterMixin reads, for a tiny Qwen2/Qwen3 (fp32, as transformers' testers build)."""

    def __init__(self, parent, config_class, batch_size=4, seq_length=7):
        self.parent = parent
        self.config_class = config_class
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.is_training = True
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.head_dim = 8
        self.intermediate_size = 37
        self.num_labels = 3

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, intermediate_size=self.intermediate_size, hidden_act="silu",
            max_position_embeddings=512, initializer_range=0.02, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            num_labels=self.num_labels)

    def prepare_config_and_inputs_for_common(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = random_attention_mask([self.batch_size, self.seq_length])
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


# GenerationTesterMixin is the empty stand-in: inheriting it only satisfies the mixin's own
# test_generation_tester_mixin_inheritance (a check on how test classes are written); no generate() test runs here
class _QwenCommon(ModelTesterMixin, GenerationTesterMixin):
    config_class = None
    alignment: str = "stock"

    def setUp(self):
        global _active
        self.model_tester = QwenTester(self, self.config_class)
        _active = self.alignment

    def tearDown(self):
        global _active
        _active = None

    def test_roundalign_injection(self):
        """Ours, not transformers': every class this test class builds carries the intended alignment."""
        config, _ = self.model_tester.prepare_config_and_inputs_for_common()
        for model_class in self.all_model_classes:
            expected = ALIGNMENTS[self.alignment] or ("baseline", "vllm-compiled", "eager")
            self.assertEqual(alignment_of(model_class(config)), expected, model_class.__name__)


def _selected(env: str, choices: dict) -> list[str]:
    names = [n for n in os.environ.get(env, ",".join(choices)).split(",") if n]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise ValueError(f"{env}: unknown {unknown}; valid: {', '.join(choices)}")
    return names


for _arch in _selected("ROUNDALIGN_HF_ARCHS", ARCHS):
    for _name in _selected("ROUNDALIGN_HF_ALIGNMENTS", ALIGNMENTS):
        _config, _classes = ARCHS[_arch]
        _cls_name = f"{_arch.capitalize()}_{_name}"
        globals()[_cls_name] = type(_cls_name, (_QwenCommon, unittest.TestCase), {
            "config_class": _config, "all_model_classes": _classes, "alignment": _name,
            "__module__": __name__})
