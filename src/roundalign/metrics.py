"""Train-vs-engine log-probability mismatch metrics.

This module owns the *definitions* of every mismatch number the project reports: given, for
the same sampled tokens, the log-probability the trainer assigns (``train_logp``) and the one
the inference engine reported when it sampled them (``engine_logp``), it reduces them to
scalar statistics at token level and at sequence level.

Conventions (all in natural log units, "nats"):

* ``delta = train_logp - engine_logp`` on each sampled completion token.
* ``rho = exp(delta)`` is the per-token importance ratio pi_train / pi_engine.
* At sequence level ``delta_seq = sum(delta)`` over the sequence's completion tokens and
  ``rho_seq = exp(delta_seq)``.
* Since the tokens were sampled from the engine, ``mean(-delta)`` estimates KL(engine || train)
  (``k1``), ``mean(rho - 1 - delta)`` is the low-variance, always non-negative estimator of the
  same KL (``k3``), and ``mean(rho^2) - 1`` estimates the chi^2 divergence (``chi2``).

Everything here is a pure tensor function: no I/O, no logging, and no ``.item()`` (only
:func:`flatten_metrics`, which exists to turn results into Python floats, calls it). Results
are 0-dim float64 tensors on the input device. The only host synchronisations are the ones
data-dependent shapes force: the empty-mask check and boolean-mask indexing.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "METRIC_NAMES_SEQUENCE",
    "METRIC_NAMES_TOKEN",
    "VERL_HEALTH_THRESHOLDS",
    "flatten_metrics",
    "mismatch_metrics",
    "verl_health_flags",
]

# Statistics computed the same way on a vector of log-ratios, whether per token or per sequence.
_DELTA_STATS = (
    "logp_abs_diff_mean",
    "logp_abs_diff_max",
    "logp_diff_rms",
    "logp_diff_mean",
    "mismatch_k1",
    "mismatch_k3",
    "mismatch_chi2",
    "is_ratio_min",
    "is_ratio_mean",
    "is_ratio_max",
    "is_ratio_outside_frac",
    "ess_frac",
)

#: Every key ``mismatch_metrics(...)["token"]`` can hold, in a stable order.
#: ``k3_over_entropy`` is present only when ``entropy`` is passed.
METRIC_NAMES_TOKEN: tuple[str, ...] = _DELTA_STATS + (
    "is_ratio_std",
    "token_mult_prob_error",
    "ppl_train",
    "ppl_engine",
    "tokens_exact_frac",
    "k3_over_entropy",
    "num_tokens",
)

#: Every key ``mismatch_metrics(...)["sequence"]`` holds, in a stable order.
METRIC_NAMES_SEQUENCE: tuple[str, ...] = _DELTA_STATS + (
    "ppl_train",
    "ppl_engine",
    "seqs_exact_frac",
    "num_seqs",
)

# All arithmetic is float64, whatever the input dtype. The mismatch we measure is tiny: for
# |delta| ~ 1e-4 nats, k3 = rho - 1 - delta ~ delta^2 / 2 ~ 5e-9. In float32, rho - 1 - delta
# subtracts numbers of size ~1 that agree to ~9 digits, leaving only rounding noise (fp32 eps is
# ~1.2e-7, far above 5e-9); even the delta itself loses digits if formed in the input dtype.
# Differences of fp32/bf16/fp16 values are exact in float64, and expm1(delta) - delta keeps
# ~13 significant digits of k3 at |delta| ~ 1e-4 (relative error ~2 * eps64 / |delta|).
_F64 = torch.float64


def _check_inputs(
    train_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None,
    is_clip: float,
) -> None:
    for name, t in (("train_logp", train_logp), ("engine_logp", engine_logp), ("entropy", entropy)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"mask must be a torch.bool tensor (True = completion token), got {got}")
    if train_logp.dim() != 2:
        raise ValueError(f"train_logp must have shape (B, T), got {tuple(train_logp.shape)}")
    shapes = {"train_logp": train_logp.shape, "engine_logp": engine_logp.shape, "mask": mask.shape}
    if entropy is not None:
        shapes["entropy"] = entropy.shape
    if len(set(shapes.values())) != 1:
        desc = ", ".join(f"{k}={tuple(v)}" for k, v in shapes.items())
        raise ValueError(f"input shapes must all match (B, T): {desc}")
    is_real = isinstance(is_clip, numbers.Real) and not isinstance(is_clip, bool)
    if not (is_real and math.isfinite(is_clip) and is_clip >= 1.0):
        raise ValueError(f"is_clip must be a finite number >= 1, got {is_clip!r}")
    # Host sync: unavoidable to raise on an empty mask.
    if not bool(mask.any()):
        raise ValueError(
            "mask selects no tokens: mismatch metrics need at least one completion token "
            f"(mask shape {tuple(mask.shape)})"
        )


def _delta_stats(delta: torch.Tensor, is_clip: float) -> dict[str, torch.Tensor]:
    """Statistics of a non-empty 1-D float64 vector of log-ratios (nats) and of rho = exp(delta).

    Entries are 0-dim float64 tensors. Ratio-valued entries are unitless; the ``logp_*`` and
    ``mismatch_*`` entries are in nats (chi2 is unitless).
    """
    n = delta.numel()
    abs_delta = delta.abs()
    rho = torch.exp(delta)
    # ESS fraction = (sum rho)^2 / (N * sum rho^2), i.e. 1 / (N * sum(w^2)) with w = rho / sum(rho).
    # Scaling rho by exp(-max delta) leaves it unchanged and avoids overflow for the large
    # sequence-level log-ratios; all-equal rho gives exactly N^2 / (N * N) = 1.
    r = torch.exp(delta - delta.max())
    outside = (rho < 1.0 / is_clip) | (rho > is_clip)
    return {
        "logp_abs_diff_mean": abs_delta.mean(),
        "logp_abs_diff_max": abs_delta.max(),
        "logp_diff_rms": delta.square().mean().sqrt(),
        "logp_diff_mean": delta.mean(),
        "mismatch_k1": (-delta).mean(),
        # rho - 1 - delta without cancelling 1 against rho.
        "mismatch_k3": (torch.expm1(delta) - delta).mean(),
        # mean(rho^2) - 1 == mean(rho^2 - 1) == mean(expm1(2 delta)).
        "mismatch_chi2": torch.expm1(2.0 * delta).mean(),
        "is_ratio_min": rho.min(),
        "is_ratio_mean": rho.mean(),
        "is_ratio_max": rho.max(),
        "is_ratio_outside_frac": outside.to(_F64).mean(),
        "ess_frac": r.sum().square() / (n * r.square().sum()),
    }


@torch.no_grad()
def mismatch_metrics(
    train_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor | None = None,
    is_clip: float = 2.0,
) -> dict[str, dict[str, torch.Tensor]]:
    """Token- and sequence-level mismatch between trainer and engine log-probabilities.

    Args:
        train_logp: (B, T) float, trainer log-probability of each sampled token, nats.
        engine_logp: (B, T) float, engine log-probability of the same tokens, nats. May have a
            different floating dtype from ``train_logp``.
        mask: (B, T) bool, True on completion tokens. Values at False positions are ignored
            entirely (they may hold anything, including inf/NaN).
        entropy: optional (B, T) float, trainer per-token entropy in nats; adds
            ``token/k3_over_entropy`` (unitless) = ``mismatch_k3 / mean(entropy)``.
        is_clip: importance-ratio band: ``is_ratio_outside_frac`` is the fraction of ratios
            strictly outside ``[1 / is_clip, is_clip]``. Must be >= 1.

    Returns:
        ``{"token": {...}, "sequence": {...}}``, keys as in :data:`METRIC_NAMES_TOKEN` and
        :data:`METRIC_NAMES_SEQUENCE`; each value a 0-dim float64 tensor on the input device.
        Token statistics pool all masked tokens of the batch. Sequence statistics use one
        log-ratio per sequence, the sum of its token deltas; sequences without any masked
        token are excluded. ``ppl_*`` at sequence level is ``exp(-mean over sequences of the
        per-sequence mean logp)``. "Exact" means ``train_logp == engine_logp`` compared in the
        input dtypes (before any conversion; mixed dtypes are promoted losslessly), so
        e.g. bf16 values one ulp apart are not exact.

    Raises:
        ValueError: non-tensor or non-floating inputs, mask not bool, shapes not all (B, T)
            and equal (message names the shapes), ``is_clip`` < 1, or mask selecting no token.

    Non-finite values at masked positions (e.g. an engine logp of -inf) propagate into the
    results rather than being filtered.
    """
    _check_inputs(train_logp, engine_logp, mask, entropy, is_clip)
    is_clip = float(is_clip)

    # Exactness is judged on the inputs as given, before float64 conversion.
    exact = train_logp.detach() == engine_logp.detach()  # (B, T) bool
    t64 = train_logp.detach().to(_F64)
    e64 = engine_logp.detach().to(_F64)
    delta = t64 - e64  # (B, T) float64 nats; garbage at masked-out positions, never read there

    # ---- token level: all masked tokens pooled ----
    token = _delta_stats(delta[mask], is_clip)
    rho_tok = torch.exp(delta[mask])
    # population std of the token ratios (verl's rollout_is_std, without its clamping to the IS thresholds)
    token["is_ratio_std"] = (rho_tok.square().mean() - rho_tok.mean().square()).clamp(min=0).sqrt()
    # NeMo-RL's token_mult_prob_error: mean over tokens of exp(|logp_gen - logp_train|), >= 1, 1 = identical.
    # NVIDIA-NeMo/RL nemo_rl/algorithms/loss_functions.py, ClippedPGLossFn.__call__ (read at commit 005a098a):
    # lp_error = abs(generation_logprobs - prev_logprobs); masked_mean(exp(lp_error * mask), mask).
    token["token_mult_prob_error"] = torch.exp(delta[mask].abs()).mean()
    token["ppl_train"] = torch.exp(-t64[mask].mean())
    token["ppl_engine"] = torch.exp(-e64[mask].mean())
    token["tokens_exact_frac"] = exact[mask].to(_F64).mean()
    if entropy is not None:
        token["k3_over_entropy"] = token["mismatch_k3"] / entropy.detach()[mask].to(_F64).mean()
    token["num_tokens"] = mask.sum().to(_F64)

    # ---- sequence level: one log-ratio per sequence with >= 1 masked token ----
    counts = mask.sum(dim=1)  # (B,)
    has_tokens = counts > 0  # (B,) bool, at least one is True (checked above)
    zero = torch.zeros((), dtype=_F64, device=delta.device)
    delta_seq = torch.where(mask, delta, zero).sum(dim=1)[has_tokens]  # (S,) nats
    n_seq = counts[has_tokens].to(_F64)  # (S,)
    mean_train = torch.where(mask, t64, zero).sum(dim=1)[has_tokens] / n_seq  # (S,) nats/token
    mean_engine = torch.where(mask, e64, zero).sum(dim=1)[has_tokens] / n_seq
    seq_exact = (exact | ~mask).all(dim=1)[has_tokens]  # (S,) bool

    sequence = _delta_stats(delta_seq, is_clip)
    sequence["ppl_train"] = torch.exp(-mean_train.mean())
    sequence["ppl_engine"] = torch.exp(-mean_engine.mean())
    sequence["seqs_exact_frac"] = seq_exact.to(_F64).mean()
    sequence["num_seqs"] = has_tokens.sum().to(_F64)

    return {
        "token": {k: token[k] for k in METRIC_NAMES_TOKEN if k in token},
        "sequence": {k: sequence[k] for k in METRIC_NAMES_SEQUENCE},
    }


#: verl's rollout-correction health thresholds, from ``check_rollout_correction_health`` in volcengine/verl
#: docs/algo/rollout_corr.md (read at commit b54386e4): warn when the mean IS weight is < 0.5 or > 2.0, the
#: effective sample size < 0.3, the IS weight std > 1.0, |kl| > 0.1, or chi2_token > 1.0. verl's definitions
#: (``compute_offpolicy_metrics`` / ``compute_rollout_correction_and_rejection_mask`` in
#: verl/trainer/ppo/rollout_corr_helper.py): kl = mean(logp_rollout - logp_training) = our k1;
#: chi2_token = mean(ratio^2) - 1 = our token chi2; ESS = 1 / mean((w / mean w)^2) = our ess_frac. Differences:
#: verl clamps the weights to its IS thresholds before the ESS and std; we use the raw token ratios (on the
#: small mismatch measured here the two agree: no ratio is near a threshold unless a check already fails).
VERL_HEALTH_THRESHOLDS = {"is_mean_low": 0.5, "is_mean_high": 2.0, "ess_min": 0.3, "is_std_max": 1.0,
                          "abs_kl_max": 0.1, "chi2_token_max": 1.0}


def verl_health_flags(token: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Which of verl's rollout-correction health checks a step violates, from ``mismatch_metrics(...)["token"]``.

    Returns 0-dim float64 tensors, 1.0 = violated: ``is_mean`` (IS mean outside [0.5, 2]), ``ess``
    (ESS fraction < 0.3), ``is_std`` (ratio std > 1), ``kl`` (|k1| > 0.1 nats), ``chi2`` (chi2_token > 1) and
    ``any`` (at least one). Thresholds: :data:`VERL_HEALTH_THRESHOLDS`.
    """
    t = VERL_HEALTH_THRESHOLDS
    m = token["is_ratio_mean"]
    flags = {
        "is_mean": (m < t["is_mean_low"]) | (m > t["is_mean_high"]),
        "ess": token["ess_frac"] < t["ess_min"],
        "is_std": token["is_ratio_std"] > t["is_std_max"],
        "kl": token["mismatch_k1"].abs() > t["abs_kl_max"],
        "chi2": token["mismatch_chi2"] > t["chi2_token_max"],
    }
    flags["any"] = flags["is_mean"] | flags["ess"] | flags["is_std"] | flags["kl"] | flags["chi2"]
    return {k: v.to(_F64) for k, v in flags.items()}


def flatten_metrics(d: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """Flatten ``mismatch_metrics`` output to ``{"token/mismatch_k3": float, ...}``.

    Unlike the rest of this module this calls ``.item()`` on every value (one host sync per
    entry); call it once per logging step, not inside a hot loop.
    """
    return {f"{level}/{name}": float(v.item()) for level, metrics in d.items() for name, v in metrics.items()}
