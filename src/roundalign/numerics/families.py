"""The model-family registry: one ``Family`` per Hugging Face architecture ``apply_alignment`` can align.

A family says where its modules are (the transformers module and the class-name prefix of its RMSNorm, MLP,
attention, decoder layer and model classes), whether its attention normalises q and k before RoPE (Qwen3's q/k
norms), and which RoPE parameterisations the alignment is verified for (``rope_types``: RoPE's rounding sits in the
region after the cos/sin tables, so a scaled RoPE is aligned when the trainer and the engine use the same tables;
``tests/vllm_cpu/test_rope_tables.py`` compares every family's tables with vLLM's ``get_rope`` for each type, and
``tests/vllm_cpu/test_families_real.py`` measures families against real vLLM-CPU end to end). The patch
(``numerics/patch.py``) builds its aligned classes from these records and refuses every other class with one line
naming the supported ones.

The module imports nothing of the package or of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the head classes of a family that apply_alignment accepts, besides the trunk (``<prefix>Model``)
HEADS = ("ForCausalLM", "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


@dataclass(frozen=True)
class Family:
    """A model family.

    Attributes:
        name: the family's name (``qwen2``), as ``roundalign.models.tiny`` and configs spell it.
        module: the transformers module that defines its classes.
        prefix: the class-name prefix (``Qwen2`` for ``Qwen2RMSNorm``, ``Qwen2MLP``, ``Qwen2Attention``,
            ``Qwen2DecoderLayer``, ``Qwen2Model``, ``Qwen2ForCausalLM``).
        qk_norm: its attention RMS-normalises q and k per head before RoPE (a fourth aligned site).
        rope_types: the ``rope_type`` values the alignment is verified for on this family: the trainer's cos/sin
            table is vLLM's bitwise (stock, or ``patch.engine_rotary``'s for linear scaling), and the emulated
            engine builds the same (``vllm_native.vllm_rope_table``); ``tests/vllm_cpu/test_rope_tables.py`` checks
            both against vLLM's ``get_rope``.
        note: what a reader should know (checkpoints that load as it).
        moe: its decoder layers' MLP is a mixture-of-experts block (``<prefix>SparseMoeBlock``, a router and fused
            experts) where the config makes the layer sparse, else the dense ``<prefix>MLP``. The block is aligned
            by ``numerics/moe.py`` against the engines with a measured MoE map only (``EngineSpec.moe_router``: vLLM-CPU's);
            ``apply_alignment`` refuses every other engine for such a family.
    """

    name: str
    module: str
    prefix: str
    qk_norm: bool
    rope_types: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "llama3")
    note: str = ""
    moe: bool = False

    @property
    def model_classes(self) -> tuple[str, ...]:
        return (f"{self.prefix}Model", *(self.prefix + h for h in HEADS))


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2", qk_norm=False,
           note="Qwen2.5 checkpoints load as Qwen2"),
    Family("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3", qk_norm=True),
    Family("llama", "transformers.models.llama.modeling_llama", "Llama", qk_norm=False,
           note="Llama 3 and 3.1 checkpoints, with their rope scaling"),
    # Qwen3's dense regions (q/k norm, RoPE, residual add + RMSNorm) with an MoE block measured against vLLM-CPU
    # only (docs/numerics.md, "Qwen3-MoE"; tests/vllm_cpu/test_moe_real.py); its default RoPE is the one measured
    Family("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", qk_norm=True,
           rope_types=("default",), moe=True),
)}


#: families measured against the engine but not aligned yet: model_type -> (class-name prefix, where the measurement
#: is); their refusal says so
MEASURED_NOT_ALIGNED: dict[str, tuple[str, str]] = {}


def not_aligned_yet(model_type: str | None = None, cls_name: str | None = None) -> str:
    """The refusal's extra sentence for a family in ``MEASURED_NOT_ALIGNED`` (by model_type or class name), or ""."""
    for mt, (prefix, where) in MEASURED_NOT_ALIGNED.items():
        if model_type == mt or (cls_name or "").startswith(prefix):
            return f" {prefix} is measured against vLLM-CPU but not aligned yet: {where}."
    return ""


def rope_type(rope_parameters: dict | None) -> str:
    """The ``rope_type`` of a config's ``rope_parameters`` (or legacy ``rope_scaling``, whose key was ``type``)."""
    params = rope_parameters or {}
    return params.get("rope_type", params.get("type", "default"))


def family_of_class(cls_name: str) -> Family | None:
    """The family whose model classes include ``cls_name``, or None."""
    return next((f for f in FAMILIES.values() if cls_name in f.model_classes), None)


def supported_model_classes() -> tuple[str, ...]:
    return tuple(c for f in FAMILIES.values() for c in f.model_classes)
