"""Collapse detectors of a GRPO run, each a small state machine fed one value per logged step.

- :class:`RewardCollapse`: the rolling ``window``-step mean reward stays below ``drop`` x its best so far for
  ``patience`` consecutive steps. The event's step is the first step of that streak (its onset),
  ``detected_step`` the step that confirmed it.
- :class:`GradNormCollapse`: the gradient norm exceeds ``factor`` x the median of every earlier step's norm, after
  ``min_steps`` steps (off when ``factor`` is 0). A non-finite norm is not this detector's business: the runner
  stops on it as a non-finite collapse.

Each flags at most once (its ``event``) and saves and restores exactly its own state (``state_dict`` /
``load_state_dict``: the keys ``roundalign_state.json`` of a checkpoint holds), so a resumed run continues the same
detection as an uninterrupted one. ``roundalign.training.train`` feeds them from its callback.
"""

from __future__ import annotations

import math
import statistics


def _finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


class RewardCollapse:
    """Rolling-mean reward collapse (module docstring)."""

    def __init__(self, window: int, drop: float, patience: int):
        if window < 1 or patience < 1 or not 0 < drop <= 1:
            raise ValueError(f"reward collapse: window={window} and patience={patience} must be >= 1 and "
                             f"drop={drop} in (0, 1]")
        self.window, self.drop, self.patience = window, drop, patience
        self.best_reward_mean = -math.inf
        self.rewards: list[float] = []
        self.below_steps = 0  # consecutive steps with the rolling mean below the collapse line
        self.event: dict | None = None

    def update(self, step: int, reward: float | None) -> dict | None:
        """Feed the step's mean reward; returns the event on the step it is flagged, else None."""
        if reward is None or self.event is not None:
            return None
        self.rewards.append(reward)
        w = self.window
        if len(self.rewards) < w:
            return None
        mean = sum(self.rewards[-w:]) / w
        flagged = None
        if self.best_reward_mean > 0 and mean < self.drop * self.best_reward_mean:
            self.below_steps += 1
            if self.below_steps >= self.patience:
                flagged = self.event = {
                    "step": step - self.below_steps + 1, "detected_step": step,
                    "reason": f"rolling {w}-step reward mean below {self.drop} x its best "
                              f"({self.best_reward_mean:.4g}) for {self.below_steps} consecutive steps "
                              f"(now {mean:.4g})"}
        else:
            self.below_steps = 0
        self.best_reward_mean = max(self.best_reward_mean, mean)
        return flagged

    def state_dict(self) -> dict:
        return {"best_reward_mean": self.best_reward_mean, "rewards": list(self.rewards),
                "below_steps": self.below_steps, "reward_collapse": self.event}

    def load_state_dict(self, state: dict) -> None:
        self.best_reward_mean = state.get("best_reward_mean", -math.inf)
        self.rewards = list(state.get("rewards", []))
        self.below_steps = state.get("below_steps", 0)
        self.event = state.get("reward_collapse")


class GradNormCollapse:
    """Gradient-norm spike against the running median (module docstring)."""

    def __init__(self, factor: float, min_steps: int):
        if factor < 0 or min_steps < 1:
            raise ValueError(f"grad-norm collapse: factor={factor} must be >= 0 (0: off), min_steps={min_steps} >= 1")
        self.factor, self.min_steps = factor, min_steps
        self.grad_norms: list[float] = []
        self.event: dict | None = None

    def update(self, step: int, grad_norm: float | None) -> dict | None:
        """Feed the step's gradient norm; returns the event on the step it is flagged, else None."""
        if not _finite(grad_norm):
            return None
        flagged = None
        k = self.factor
        if k and self.event is None and len(self.grad_norms) >= self.min_steps:
            median = statistics.median(self.grad_norms)
            if median > 0 and grad_norm > k * median:
                flagged = self.event = {
                    "step": step, "reason": f"grad norm {grad_norm:.4g} > {k} x the median {median:.4g} of "
                                            f"{len(self.grad_norms)} earlier steps"}
        self.grad_norms.append(grad_norm)
        return flagged

    def state_dict(self) -> dict:
        return {"grad_norms": list(self.grad_norms), "grad_norm_collapse": self.event}

    def load_state_dict(self, state: dict) -> None:
        self.grad_norms = list(state.get("grad_norms", []))
        self.event = state.get("grad_norm_collapse")
