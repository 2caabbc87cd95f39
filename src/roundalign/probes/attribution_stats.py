"""The numbers of ``roundalign attribute``: per-sequence sums of the train-vs-engine log-prob differences, the metrics
of a resample of prompts, the waterfall's steps, and the long table with percentile-bootstrap intervals (the same
resamples for every step, so that the k3 a step removes is a paired difference)."""

from __future__ import annotations

import torch

from roundalign.settings import SOURCES

METRICS = ("k3", "abs_dlogp", "exact_frac", "seq_log_ratio", "is_ratio_mean", "is_ratio_max")


def per_sequence(train: list[torch.Tensor], ref: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sequence sums (float64) from which every metric of a resample is a ratio of sums or a mean."""
    stats = {k: [] for k in ("k3", "abs", "exact", "n", "seq")}
    for t, r in zip(train, ref, strict=True):
        d = t.double() - r.double()
        stats["k3"].append((torch.expm1(d) - d).sum())
        stats["abs"].append(d.abs().sum())
        stats["exact"].append((t == r).double().sum())
        stats["n"].append(torch.tensor(float(len(d)), dtype=torch.float64))
        stats["seq"].append(d.sum())
    return {k: torch.stack(v) for k, v in stats.items()}


def resample_metrics(s: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, float]:
    n = s["n"][idx].sum()
    seq = s["seq"][idx]
    return {"k3": float(s["k3"][idx].sum() / n), "abs_dlogp": float(s["abs"][idx].sum() / n),
            "exact_frac": float(s["exact"][idx].sum() / n), "seq_log_ratio": float(seq.mean()),
            "is_ratio_mean": float(seq.exp().mean()), "is_ratio_max": float(seq.exp().max())}


def interval(values: list[float]) -> tuple[float, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return float(torch.quantile(t, 0.025)), float(torch.quantile(t, 0.975))


def steps_of(present: dict[str, str | None]) -> list[tuple[int, str, str, frozenset]]:
    """(step, source, mode, equalized set) of the waterfall: step 0 ``none``, then each present source
    cumulatively in SOURCES order, then each alone (numbered as in the cumulative order)."""
    order = [s for s in SOURCES if present[s] is None]
    steps = [(0, "none", "cumulative", frozenset())]
    steps += [(i, s, "cumulative", frozenset(order[:i])) for i, s in enumerate(order, 1)]
    steps += [(i, s, "alone", frozenset([s])) for i, s in enumerate(order, 1)]
    return steps


def attribution_rows(scored: dict[frozenset, dict[str, torch.Tensor]], steps, num_resamples: int, seed: int):
    """The long table: every step's metrics with bootstrap intervals over prompts, and the k3 each step removes
    (paired: the same resamples for every step)."""
    n = len(next(iter(scored.values()))["n"])
    g = torch.Generator().manual_seed(seed)
    draws = [torch.randint(n, (n,), generator=g) for _ in range(num_resamples)]
    everyone = torch.arange(n)
    boot = {st: [resample_metrics(s, idx) for idx in draws] for st, s in scored.items()}
    point = {st: resample_metrics(s, everyone) for st, s in scored.items()}
    rows = []
    prev_cumulative = frozenset()
    for step, source, mode, state in steps:
        for metric in METRICS:
            lo, hi = interval([b[metric] for b in boot[state]])
            rows.append({"step": step, "source": source, "mode": mode, "metric": metric,
                         "value": point[state][metric], "ci_low": lo, "ci_high": hi})
        if step == 0:
            continue
        base = prev_cumulative if mode == "cumulative" else frozenset()
        removed = [a["k3"] - b["k3"] for a, b in zip(boot[base], boot[state], strict=True)]
        lo, hi = interval(removed)
        rows.append({"step": step, "source": source, "mode": mode, "metric": "k3_removed",
                     "value": point[base]["k3"] - point[state]["k3"], "ci_low": lo, "ci_high": hi})
        if mode == "cumulative":
            prev_cumulative = state
    return rows
