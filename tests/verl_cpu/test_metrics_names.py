"""``rollout_corr_metrics`` gives, under verl's ``rollout_corr/`` names, the values verl 0.9.1's own
``compute_offpolicy_metrics`` and ``compute_is_metrics`` compute from the same log-probs."""

import pytest

pytest.importorskip("verl", reason="verl 0.9.1 is not installed: tools/envs/verl_env.sh .venv-verl (conftest.py)")

import torch  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_is_metrics, compute_offpolicy_metrics  # noqa: E402

from roundalign.integrations.verl import rollout_corr_metrics  # noqa: E402
from roundalign.metrics import mismatch_metrics  # noqa: E402


def _batch(seed=0, rows=6, cols=9):
    """Engine and trainer log-probs a few 1e-2 nats apart, ragged right-padded responses (every row keeps at least
    one token: verl's chi2_seq averages over all rows, ours over rows with a token). float64, so that any gap
    beyond verl's 1e-8 guards in its divisions is a difference of definition, not of rounding."""
    g = torch.Generator().manual_seed(seed)
    engine = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 4
    train = engine + 0.03 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    mask = torch.ones(rows, cols, dtype=torch.bool)
    for i in range(rows):
        mask[i, cols - i:] = False
    return train, engine, mask


def test_names_and_values_are_verls():
    train, engine, mask = _batch()
    ours = rollout_corr_metrics(mismatch_metrics(train, engine, mask, is_clip=2.0))

    verl = {f"rollout_corr/{k}": v for k, v in compute_offpolicy_metrics(train, engine, mask.double()).items()}
    ratio = torch.exp(train - engine) * mask  # verl's token IS weights before truncation; none is above 2 here
    assert ratio.max() < 2.0 and ratio[mask].min() > 0.5
    verl.update({f"rollout_corr/{k}": v for k, v in compute_is_metrics(
        ratio, ratio, train - engine, mask.double(), rollout_is="token", rollout_is_threshold=2.0).items()})

    assert set(ours) <= set(verl), sorted(set(ours) - set(verl))
    for name, value in ours.items():
        # rel 1e-6: verl's masked means divide by (count + 1e-8), 2.6e-10 relative here, which the cancellations in
        # chi2_token (mean(rho^2) - 1) and rollout_is_std (mean(w^2) - mean(w)^2) lift to 1.2e-7 and 2.0e-7 (measured);
        # a difference of definition (perplexity of the mean, truncated weights, rows without tokens) is >= 1e-3
        assert value.item() == pytest.approx(verl[name], rel=1e-6, abs=1e-12), name
    # the mapping is not vacuous: the batch is off-policy by a measurable amount
    assert ours["rollout_corr/k3_kl"].item() > 1e-5 and abs(ours["rollout_corr/log_ppl_diff"].item()) > 1e-4
