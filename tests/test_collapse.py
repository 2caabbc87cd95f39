"""The collapse detectors on their own (roundalign.training.collapse): onset and detection steps worked out by hand,
flag-once, non-finite and missing values, and a save/restore in the middle equal to an uninterrupted run."""

import math

import pytest

from roundalign.training.collapse import GradNormCollapse, RewardCollapse


def _feed(det, values, start=1):
    return {step: ev for step, v in enumerate(values, start) if (ev := det.update(step, v))}


def test_reward_collapse_onset_is_the_first_step_of_the_streak():
    # window 3: rolling means 1.0 (steps 3-10), 0.767 (11), 0.533 (12), 0.3 (13, 14): below 0.5 x best from 13 on
    rewards = [1.0] * 10 + [0.3] * 6
    det = RewardCollapse(window=3, drop=0.5, patience=2)
    events = _feed(det, rewards)
    assert list(events) == [14]
    assert events[14]["step"] == 13 and events[14]["detected_step"] == 14
    assert "below 0.5 x its best (1)" in events[14]["reason"]
    assert det.update(17, 0.0) is None and det.event is events[14]  # flags once


def test_reward_collapse_needs_the_whole_streak_and_ignores_missing_steps():
    det = RewardCollapse(window=2, drop=0.5, patience=3)
    # below the line for 2 steps, back above, then 3 steps below: the streak restarts
    rewards = [1.0, 1.0, 0.2, 0.2, 1.0, 1.0, None, 0.1, 0.1, 0.1, 0.1]
    events = _feed(det, rewards)
    # rolling means (window 2, the None skipped) from step 2: 1, .6, .2 (below: 1 step), .6, 1 (reset), then at
    # steps 8-11: .55, .1, .1, .1: below from step 9, the third such step (11) confirms it
    assert list(events) == [11] and events[11]["step"] == 9
    assert _feed(RewardCollapse(window=3, drop=0.5, patience=1), [0.0] * 5) == {}  # best 0: nothing to fall from


def test_grad_norm_collapse_against_the_median_of_earlier_steps():
    det = GradNormCollapse(factor=5.0, min_steps=3)
    norms = [1.0, 1.2, 0.8, math.nan, 5.5, 6.1, 40.0, 100.0]
    events = _feed(det, norms)
    # step 5: 5.5 > 5 x median(1, 1.2, 0.8) = 5.0 -> flagged; the NaN (step 4) is neither counted nor flagged here
    assert list(events) == [5] and "5.5 > 5.0 x the median 1 of 3 earlier steps" in events[5]["reason"]
    assert det.grad_norms == [1.0, 1.2, 0.8, 5.5, 6.1, 40.0, 100.0]
    assert _feed(GradNormCollapse(factor=0.0, min_steps=1), [1.0, 1e9]) == {}  # factor 0: off


@pytest.mark.parametrize("cut", [1, 5, 11, 13])
def test_a_restored_detector_continues_exactly_as_an_uninterrupted_one(cut):
    rewards = [0.2, 0.5, 0.9, 1.0, 1.0, 0.95, 0.6, 0.4, 0.3, 0.2, 0.2, 0.2, 0.1, 0.1, 0.1]
    norms = [1.0, 1.1, 0.9, 1.0, 1.3, 0.7, 1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 50.0, 1.0, 1.0]
    whole_r, whole_g = RewardCollapse(3, 0.5, 2), GradNormCollapse(4.0, 5)
    expected = (_feed(whole_r, rewards), _feed(whole_g, norms))
    first_r, first_g = RewardCollapse(3, 0.5, 2), GradNormCollapse(4.0, 5)
    got_r, got_g = _feed(first_r, rewards[:cut]), _feed(first_g, norms[:cut])
    saved = {**first_r.state_dict(), **first_g.state_dict()}  # as roundalign_state.json holds them
    second_r, second_g = RewardCollapse(3, 0.5, 2), GradNormCollapse(4.0, 5)
    second_r.load_state_dict(saved)
    second_g.load_state_dict(saved)
    got_r.update(_feed(second_r, rewards[cut:], start=cut + 1))
    got_g.update(_feed(second_g, norms[cut:], start=cut + 1))
    assert (got_r, got_g) == expected and expected[0] and expected[1]
    assert second_r.state_dict() == whole_r.state_dict() and second_g.state_dict() == whole_g.state_dict()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="window=0"):
        RewardCollapse(0, 0.5, 1)
    with pytest.raises(ValueError, match="factor=-1"):
        GradNormCollapse(-1, 3)
