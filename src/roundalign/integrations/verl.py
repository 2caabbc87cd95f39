"""roundalign inside verl 0.9.1: the module a user names as ``actor_rollout_ref.model.external_lib``.

Design note
-----------
verl imports each ``external_lib`` module by name (``HFModelConfig.__post_init__`` ->
``verl.utils.import_utils.import_external_libs``, a plain ``importlib.import_module``) and hands it nothing: no
model, no config. So this module acts on import, where verl 0.9.1 is installed, by wrapping four places in verl's
own code; each wrapper acts only for an engine whose model config names this module as its ``external_lib`` (a
critic, or a second model in the same process without it, stays stock):

1. Model construction. ``FSDPEngine._build_module`` (``verl/workers/engine/fsdp/transformer_impl.py``) loads the
   Hugging Face model (fp32 for a trainer, bf16 for a forward-only reference), applies Liger and verl's own monkey
   patches, casts it and turns gradient checkpointing on. The wrapper checks the engine's settings first (guards,
   below), then runs it and aligns the module it returns, before FSDP wraps it:
   ``apply_alignment(module, variant, engine, kernels=...)``. The kernels are always passed: ``apply_alignment``
   would pick them from the dtype at apply time, and the actor is fp32 then while it computes in bf16 (FSDP's
   mixed precision casts the parameters at each forward; the aligned regions round to the activations' dtype).
2. Scoring. ``FSDPEngineWithLMHead.prepare_model_outputs`` turns logits into log-probs with two functions of that
   module: ``_scale_logits_by_temperature`` (``logits / T`` in the logits' dtype, bf16) and
   ``logprobs_from_logits`` (flash-attn's Triton cross-entropy where flash-attn is installed and
   ``VERL_DISABLE_FLASH_ATTN_CE`` is not 1, else ``logprobs_from_logits_v2``, whose log-softmax runs in bf16 on bf16
   logits). Both names are replaced in that module by the engine sampler's formula
   (``roundalign.numerics.sampler``): upcast to fp32, a true division by the fp32 temperature, log-softmax in fp32,
   gather. verl's bf16 path is coarse enough to hide much of the alignment: on the tiny Qwen2 (Qwen3) of
   ``tests/verl_cpu``, whose aligned log-probs move every response token (up to 0.11 (0.20) nats), 8 (4) of 14
   tokens' bf16 log-probs came out equal aligned and stock, and they are up to 6.5e-2 (4.5e-2) nats from the
   engine's formula on the same logits. The replacements act only while an aligned
   engine's ``prepare_model_outputs`` runs (a context variable); any other engine gets verl's functions. flash-attn's
   cross-entropy is never reached by an aligned engine, whatever ``VERL_DISABLE_FLASH_ATTN_CE`` says. The entropy
   verl computes from the same scaled logits is then the fp32 entropy of the engine's distribution. Cost: the scaled
   logits and their log-softmax are held in fp32 (as vLLM's sampler holds them), four times the bytes of verl's
   bf16 logits.
3. Engine choice. ``EngineRegistry.new`` refuses, for a model naming this module, every backend but verl's FSDP
   engine (``fsdp``, ``fsdp2``): Megatron, VeOmni, TorchTitan and Automodel build their models elsewhere and would
   train them unaligned.
4. Rollout settings. ``ActorRolloutRefWorker.init_model`` turns ``actor_rollout_ref.rollout`` into a
   ``RolloutConfig`` (``verl/workers/engine_workers.py``) in every worker that runs a rollout; the wrapper checks it
   against the engine the actor is aligned to (``check_rollout``).

Settings, from environment variables (verl passes ``external_lib`` no arguments; Ray workers inherit the driver's
environment when the driver starts the cluster, else pass them with
``+ray_kwargs.ray_init.runtime_env.env_vars.ROUNDALIGN_VARIANT=full`` and so on): ``ROUNDALIGN_VARIANT``
(default ``full``), ``ROUNDALIGN_ENGINE`` (default ``vllm-compiled``, verl's rollout default
``enforce_eager=False``), ``ROUNDALIGN_KERNELS`` (default: what ``apply_alignment`` picks for that engine on a bf16
model). ``VerlSettings`` documents them; a bad value fails at import, naming the variable and the valid values.

Guards (``check_engine``, ``check_rollout``), each naming the setting and the fix: ``use_liger`` and
``use_fused_kernels`` raise (Liger replaces the MLP, the RMSNorms and RoPE of every layer, all three aligned
regions; the fused kernels replace the LM head and log-softmax); ``use_remove_padding`` under sdpa attention warns
(verl packs the micro-batch into one row; sdpa's logits there are up to 9.4e-2 from per-sequence ones on the tiny
models of ``tests/verl_cpu``; eager attention on packed rows, and sdpa unpacked, are bitwise); an fp32
``param_dtype`` warns (the alignment is a no-op on an fp32 actor). What verl cannot run on a CPU raises with the
fix: FSDP1 (``sync_module_states`` of CPU parameters), a forward-only model under FSDP2 (verl forces pinned CPU
offload on it, the reference model) and the rollout. A rollout that is not vLLM, a vLLM-CPU map
(``vllm-cpu-*``: verl's rollout is vLLM's GPU build) or an ``enforce_eager`` that contradicts the engine raise;
top-k/top-p sampling and logprobs other than ``processed_logprobs`` warn (the scoring formula is exact for
temperature sampling only).

Without verl the module still imports (test collection, docs); ``install()`` then raises, naming the install
recipe. With another verl release it refuses at import: the wrapped internals are verl 0.9.1's.
``rollout_corr_metrics`` maps ``roundalign.metrics.mismatch_metrics`` output to verl's ``rollout_corr/`` names and
needs no verl. Tests: ``tests/verl_cpu/`` (``.venv-verl``, ``tools/envs/verl_env.sh``); docs: ``docs/verl.md``.
"""

from __future__ import annotations

import contextvars
import os
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from roundalign.numerics.engines import spec
from roundalign.numerics.patch import apply_alignment, default_kernels
from roundalign.numerics.plan import ENGINES, KERNEL_MODES, VARIANTS

#: the verl release whose internals this module wraps
VERL_VERSION = "0.9.1"
INSTALL_HINT = "tools/envs/verl_env.sh builds an environment with it (docs/verl.md)"

try:  # optional: without verl the module imports and only install() refuses
    import verl
except ImportError:
    verl = None

if verl is not None:
    if verl.__version__ != VERL_VERSION:
        raise ImportError(f"roundalign.integrations.verl wraps verl {VERL_VERSION}'s internals; this environment has "
                          f"verl {verl.__version__}: install verl=={VERL_VERSION} ({INSTALL_HINT})")
    from verl.utils.device import get_device_name
    from verl.workers import engine_workers
    from verl.workers.config import RolloutConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

ENV_VARIANT, ENV_ENGINE, ENV_KERNELS = "ROUNDALIGN_VARIANT", "ROUNDALIGN_ENGINE", "ROUNDALIGN_KERNELS"
#: backends whose model construction and scoring the hooks reach (verl's FSDP engine)
FSDP_BACKENDS = ("fsdp", "fsdp2")
_MODULE = __name__
_ENGINE_ATTR = "_roundalign_settings"  # VerlSettings on an engine this module aligned
_VERL: dict[str, object] = {}  # verl's own functions, by "owner.name", kept by install() for the wrappers
_ENGINE_SCORING = contextvars.ContextVar("roundalign_verl_engine_scoring", default=False)


@dataclass(frozen=True)
class VerlSettings:
    """What the hooks align verl's models to, read from the environment (``from_env``).

    Attributes:
        variant: ``ROUNDALIGN_VARIANT``: the regions aligned, one of ``VARIANTS`` (``full``: all three;
            ``baseline``: none, stock numerics, the engine's scoring formula still applies).
        engine: ``ROUNDALIGN_ENGINE``: the rounding map, one of ``ENGINES``; against verl's vLLM rollout
            ``vllm-compiled`` (its default, ``enforce_eager=False``) or ``vllm-eager`` (``enforce_eager=True``).
        kernels: ``ROUNDALIGN_KERNELS``: how the fp32 regions run, one of ``KERNEL_MODES``; None: what
            ``apply_alignment`` picks for ``engine`` on a bf16 model (verl's actor computes in bf16 while it is fp32
            when aligned, so the default is taken for the compute dtype, not the parameters').
    """

    variant: str = "full"
    engine: str = "vllm-compiled"
    kernels: str | None = None

    def __post_init__(self):
        for name, value, valid in ((ENV_VARIANT, self.variant, VARIANTS), (ENV_ENGINE, self.engine, ENGINES)):
            if value not in valid:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(valid)}")
        if self.kernels is not None and self.kernels not in KERNEL_MODES:
            raise ValueError(f"{ENV_KERNELS}={self.kernels!r}: expected one of {', '.join(KERNEL_MODES)} (or unset)")

    @classmethod
    def from_env(cls, environ=None) -> VerlSettings:
        env = os.environ if environ is None else environ
        return cls(variant=env.get(ENV_VARIANT) or cls.variant, engine=env.get(ENV_ENGINE) or cls.engine,
                   kernels=env.get(ENV_KERNELS) or None)

    @property
    def region_kernels(self) -> str:
        return self.kernels or default_kernels(self.engine, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# The engine sampler's formula on verl's logits


def engine_scaled_logits(logits: Tensor, temperature: Tensor, *, is_unit_temperature: bool) -> Tensor:
    """verl's logits (any dtype, [N, V] or [B, T, V]) divided by the per-row ``temperature`` as vLLM's sampler
    divides them: upcast to fp32, then a true division by the fp32 temperature (``sampler.apply_temperature``).
    ``temperature`` broadcasts against ``logits`` as in verl ([N, 1] or [B, 1, 1]); verl's clamp to 1e-8 is kept
    (a no-op for any temperature the engine samples with). A unit temperature divides by nothing (``x / 1`` is
    ``x``)."""
    x = logits.float()
    if is_unit_temperature:
        return x
    return x / temperature.clamp(min=1e-8).to(torch.float32)


def engine_logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Each row's log-prob of its label: log-softmax over the vocabulary in fp32, as vLLM's sampler computes its
    processed logprobs (``logprobs = x.log_softmax(dim=-1, dtype=torch.float32)``). Autocast is off for it (verl calls
    it inside the forward's autocast region)."""
    with torch.autocast(device_type=logits.device.type, enabled=False):
        logp = logits.float().log_softmax(dim=-1, dtype=torch.float32)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------------------------
# Guards


def _external_libs(model_config) -> list[str]:
    libs = getattr(model_config, "external_lib", None)
    if libs is None:
        return []
    return [libs] if isinstance(libs, str) else [str(lib) for lib in libs]


def names_this_module(model_config) -> bool:
    """Whether verl's ``model_config`` (an ``HFModelConfig``) names this module as an ``external_lib``."""
    return _MODULE in _external_libs(model_config)


def _attn_implementation(model_config) -> str:
    hf_config = getattr(model_config, "hf_config", None)
    attn = getattr(hf_config, "_attn_implementation", None)
    if attn is None:  # verl's own default (workers/config/model.py)
        attn = (getattr(model_config, "override_config", None) or {}).get("attn_implementation", "flash_attention_2")
    return attn


def _param_dtype(engine_config) -> str:
    mixed = getattr(engine_config, "mixed_precision", None)
    return str((mixed or {}).get("param_dtype", "bf16"))  # verl's default when unset (transformer_impl.py)


def check_engine(model_config, engine_config, device: str) -> None:
    """Raise (or warn) where verl's engine settings would bypass or undo the alignment, or cannot run on ``device``
    (``"cuda"``, ``"cpu"``, ...); each message names the setting and the fix."""
    prefix = "actor_rollout_ref.model"
    if getattr(model_config, "use_liger", False):
        raise ValueError(
            f"{prefix}.use_liger=True: Liger's kernels replace every layer's SwiGLU MLP, its RMSNorms and RoPE, the "
            f"three regions roundalign aligns, so the actor would not round where the engine does. Set "
            f"{prefix}.use_liger=False, or drop {_MODULE} from {prefix}.external_lib")
    if getattr(model_config, "use_fused_kernels", False):
        raise ValueError(
            f"{prefix}.use_fused_kernels=True: verl's fused kernels replace the LM head and log-softmax "
            f"(verl/models/transformers/monkey_patch.py) with their own formula, so the actor would not score as the "
            f"engine samples. Set {prefix}.use_fused_kernels=False")
    strategy = getattr(engine_config, "strategy", None)
    if device == "cpu" and strategy == "fsdp":
        raise ValueError(
            "actor_rollout_ref.actor.strategy=fsdp (FSDP1) cannot run on a CPU: verl builds it with "
            "sync_module_states=True, which torch refuses for CPU parameters. Set actor_rollout_ref.actor.strategy=fsdp2 "
            "(and ref.strategy=fsdp2)")
    if device == "cpu" and getattr(engine_config, "forward_only", False):
        raise ValueError(
            "a forward-only model (the reference, actor_rollout_ref.ref) cannot run on a CPU under FSDP2: verl forces "
            "CPUOffloadPolicy(pin_memory=True) on it, and pinned memory needs an accelerator. Run without a reference "
            "model on CPU (actor_rollout_ref.actor.use_kl_loss=False, algorithm.use_kl_in_reward=False)")
    attn = _attn_implementation(model_config)
    if getattr(model_config, "use_remove_padding", False) and attn == "sdpa":
        warnings.warn(
            f"{prefix}.use_remove_padding=True with attn_implementation='sdpa': verl packs the micro-batch into one "
            "row, and sdpa's logits on packed sequences differ from per-sequence logits (measured up to 9.4e-2 on "
            "tiny Qwen2 and Qwen3, aligned or not), so the actor's log-probs are not the engine's. Use "
            f"+{prefix}.override_config.attn_implementation=eager (bitwise on packed input) or flash_attention_2 on "
            f"a GPU, or set {prefix}.use_remove_padding=False", stacklevel=3)
    if _param_dtype(engine_config) in ("fp32", "float32"):
        warnings.warn(
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32: the actor computes in fp32, where "
            "every roundalign variant is a bitwise no-op; the engine rounds in bf16. Use param_dtype=bf16 to align",
            stacklevel=3)


def check_rollout(rollout, settings: VerlSettings, device: str) -> None:
    """Raise (or warn) where verl's rollout settings (``actor_rollout_ref.rollout``, a ``RolloutConfig`` or the
    same keys in a mapping) contradict the engine the actor is aligned to, or cannot run on ``device``."""
    get = rollout.get if isinstance(rollout, dict) else lambda key, default=None: getattr(rollout, key, default)
    prefix = "actor_rollout_ref.rollout"
    if device == "cpu":
        raise ValueError(
            f"verl's rollout runs its inference server (vLLM, SGLang) on an accelerator; on a CPU verl runs the actor "
            f"only: build ActorRolloutRefWorker(role='actor') (docs/verl.md). Got {prefix}.name={get('name')!r}")
    if get("name") != "vllm":
        raise ValueError(
            f"{prefix}.name={get('name')!r}: roundalign aligns the actor to vLLM's rounding "
            f"({ENV_ENGINE}={settings.engine!r}); set {prefix}.name=vllm, or drop {_MODULE} from "
            "actor_rollout_ref.model.external_lib")
    engine = spec(settings.engine)
    if engine.device != "cuda":
        raise ValueError(
            f"{ENV_ENGINE}={settings.engine!r} is a map of vLLM's CPU build; verl's rollout runs vLLM's GPU build: set "
            f"{ENV_ENGINE}=vllm-compiled ({prefix}.enforce_eager=False) or vllm-eager (enforce_eager=True)")
    eager = bool(get("enforce_eager", False))
    if eager == engine.compiled:
        want = next(n for n in ENGINES if spec(n).device == "cuda" and spec(n).compiled != eager)
        raise ValueError(
            f"{prefix}.enforce_eager={eager} runs vLLM {'eagerly' if eager else 'compiled'}, but the actor is "
            f"aligned to {settings.engine!r}: set {ENV_ENGINE}={want} or {prefix}.enforce_eager={not eager}")
    top_k, top_p = get("top_k", -1), get("top_p", 1.0)
    if top_k not in (-1, 0, None) or (top_p is not None and float(top_p) != 1.0):
        warnings.warn(
            f"{prefix}.top_k={top_k}, top_p={top_p}: the engine samples from a truncated distribution, which the "
            "actor's log-probs (full-vocabulary log-softmax at the temperature) do not model; set top_k=-1, top_p=1 "
            "for log-probs that are the engine's", stacklevel=3)
    mode = get("logprobs_mode", "processed_logprobs")
    if mode not in (None, "processed_logprobs"):
        warnings.warn(
            f"{prefix}.logprobs_mode={mode!r}: vLLM then reports log-probs of another distribution than the one it "
            "sampled from at the temperature, which the actor computes; set logprobs_mode=processed_logprobs",
            stacklevel=3)


# ---------------------------------------------------------------------------------------------------------------
# The hooks


def _require_verl() -> None:
    if verl is None:
        raise ImportError(f"roundalign.integrations.verl needs verl=={VERL_VERSION}, which is not importable here: "
                          f"{INSTALL_HINT}")


def _build_module(self):
    """``FSDPEngine._build_module``, then the alignment, for an engine whose model config names this module."""
    build = _VERL["FSDPEngine._build_module"]
    if not names_this_module(self.model_config):
        return build(self)
    settings = VerlSettings.from_env()
    check_engine(self.model_config, self.engine_config, get_device_name())
    module = build(self)
    apply_alignment(module, settings.variant, settings.engine, kernels=settings.region_kernels)
    setattr(self, _ENGINE_ATTR, settings)
    return module


def _prepare_model_outputs(self, *args, **kwargs):
    """``FSDPEngineWithLMHead.prepare_model_outputs`` with the engine's scoring formula for an aligned engine."""
    prepare = _VERL["FSDPEngineWithLMHead.prepare_model_outputs"]
    if getattr(self, _ENGINE_ATTR, None) is None:
        return prepare(self, *args, **kwargs)
    token = _ENGINE_SCORING.set(True)
    try:
        return prepare(self, *args, **kwargs)
    finally:
        _ENGINE_SCORING.reset(token)


def _scale_logits_by_temperature(logits, temperature, *, is_unit_temperature: bool):
    if _ENGINE_SCORING.get():
        return engine_scaled_logits(logits, temperature, is_unit_temperature=is_unit_temperature)
    verl_scale = _VERL["transformer_impl._scale_logits_by_temperature"]
    return verl_scale(logits, temperature, is_unit_temperature=is_unit_temperature)


def _logprobs_from_logits(logits, labels, inplace_backward=True):
    if _ENGINE_SCORING.get():
        return engine_logprobs_from_logits(logits, labels)
    return _VERL["transformer_impl.logprobs_from_logits"](logits, labels, inplace_backward=inplace_backward)


def _engine_new(cls, model_type, backend, *args, **kwargs):
    """``EngineRegistry.new``, refusing a backend whose model construction the hooks do not reach."""
    model_config = kwargs.get("model_config", args[0] if args else None)
    if backend not in FSDP_BACKENDS and model_config is not None and names_this_module(model_config):
        raise ValueError(
            f"strategy={backend!r}: {_MODULE} aligns verl's FSDP engine only (actor_rollout_ref.actor.strategy="
            f"fsdp2 or fsdp); the {backend} engine builds its model elsewhere and would train it unaligned")
    return _VERL["EngineRegistry.new"](cls, model_type, backend, *args, **kwargs)


def _omega_conf_to_dataclass(config, *args, **kwargs):
    """verl's ``omega_conf_to_dataclass`` as ``engine_workers`` calls it, checking the rollout config it builds."""
    out = _VERL["engine_workers.omega_conf_to_dataclass"](config, *args, **kwargs)
    if isinstance(out, RolloutConfig):
        check_rollout(out, VerlSettings.from_env(), get_device_name())
    return out


def _wrap(owner, name: str, wrapper, *, classmethod_: bool = False) -> None:
    """Replace ``owner.name`` (a class's method or classmethod, or a module's function) by ``wrapper``, keeping verl's
    own in ``_VERL``; a no-op where ``wrapper`` is in place already."""
    current = owner.__dict__[name]
    own = current.__func__ if classmethod_ else current
    if own is wrapper:
        return
    _VERL[f"{owner.__name__.rsplit('.', 1)[-1]}.{name}"] = own
    setattr(owner, name, classmethod(wrapper) if classmethod_ else wrapper)


def install() -> None:
    """Install the four hooks (the module docstring) into verl; run on import where verl is installed, and a no-op
    when they are in place already."""
    _require_verl()
    VerlSettings.from_env()  # a bad setting fails where verl imports this module, naming the variable
    _wrap(transformer_impl.FSDPEngine, "_build_module", _build_module)
    _wrap(transformer_impl.FSDPEngineWithLMHead, "prepare_model_outputs", _prepare_model_outputs)
    _wrap(transformer_impl, "_scale_logits_by_temperature", _scale_logits_by_temperature)
    _wrap(transformer_impl, "logprobs_from_logits", _logprobs_from_logits)
    _wrap(EngineRegistry, "new", _engine_new, classmethod_=True)
    _wrap(engine_workers, "omega_conf_to_dataclass", _omega_conf_to_dataclass)


# ---------------------------------------------------------------------------------------------------------------
# Mismatch metrics under verl's names


def rollout_corr_metrics(mismatch: dict[str, dict[str, Tensor]]) -> dict[str, Tensor]:
    """``roundalign.metrics.mismatch_metrics(train_logp, engine_logp, mask)`` output under verl 0.9.1's
    rollout-correction names (``rollout_corr/<name>``, ``verl/trainer/ppo/rollout_corr_helper.py``), for the
    statistics both define alike; 0-dim float64 tensors, nats where verl's are.

    From ``compute_offpolicy_metrics`` (verl's ``old_log_prob`` is the trainer's, ``rollout_log_prob`` the engine's):
    ``kl`` (mean of rollout - trainer = token k1), ``k3_kl``, ``chi2_token``, ``chi2_seq`` (verl averages over every
    row, ours over rows with a completion token: equal when each row has one), ``training_log_ppl``,
    ``rollout_log_ppl`` and ``log_ppl_diff`` (means over sequences of per-sequence mean -logp). From
    ``compute_is_metrics`` at ``rollout_is="token"``: ``rollout_is_mean``, ``rollout_is_max``, ``rollout_is_min``,
    ``rollout_is_std`` and ``rollout_is_eff_sample_size``, equal to verl's when no token's ratio exceeds verl's
    ``rollout_is_threshold`` (verl truncates the weights before these statistics; its ESS adds 1e-8 to a mean).
    Not mapped: verl's ``training_ppl``/``rollout_ppl`` (a mean of per-sequence perplexities, ours the perplexity of
    the mean) and the per-sequence spreads (``log_ppl_abs_diff``, ``ppl_ratio``, ...), which need per-sequence values.
    """
    token, seq = mismatch["token"], mismatch["sequence"]
    train_log_ppl, rollout_log_ppl = torch.log(seq["ppl_train"]), torch.log(seq["ppl_engine"])
    names = {
        "kl": token["mismatch_k1"],
        "k3_kl": token["mismatch_k3"],
        "chi2_token": token["mismatch_chi2"],
        "chi2_seq": seq["mismatch_chi2"],
        "training_log_ppl": train_log_ppl,
        "rollout_log_ppl": rollout_log_ppl,
        "log_ppl_diff": train_log_ppl - rollout_log_ppl,
        "rollout_is_mean": token["is_ratio_mean"],
        "rollout_is_max": token["is_ratio_max"],
        "rollout_is_min": token["is_ratio_min"],
        "rollout_is_std": token["is_ratio_std"],
        "rollout_is_eff_sample_size": token["ess_frac"],
    }
    return {f"rollout_corr/{name}": value for name, value in names.items()}


if verl is not None:
    install()

__all__ = ["VERL_VERSION", "VerlSettings", "check_engine", "check_rollout", "engine_logprobs_from_logits",
           "engine_scaled_logits", "install", "names_this_module", "rollout_corr_metrics"]

