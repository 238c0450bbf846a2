"""Bootstrap intervals over problems: their width is the binomial one, a paired gain is exact when every
problem moves the same, and per-domain blocks cover their own problems only."""

import math

import numpy as np
import pytest

from tempering.eval.intervals import bootstrap_ci, paired_gain, pass_intervals


def test_a_constant_has_a_zero_width_interval_and_an_empty_set_none():
    assert bootstrap_ci([0.25] * 50) == [0.25, 0.25]
    assert all(math.isnan(x) for x in bootstrap_ci([]))


def test_the_interval_of_a_pass_rate_has_the_binomial_width():
    values = np.random.default_rng(1).random(400) < 0.5
    low, high = bootstrap_ci(values.astype(float))
    half = 1.96 * math.sqrt(0.25 / 400)  # the normal approximation: 0.049
    assert low < values.mean() < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.15)


def test_a_paired_gain_cancels_the_problems_difficulty():
    rng = np.random.default_rng(2)
    before = rng.random(300)
    after = np.clip(before + 0.05, 0, 1.05)  # every problem up by 0.05
    gain, low, high = paired_gain(before, after)
    assert gain == pytest.approx(0.05) and low == pytest.approx(0.05) and high == pytest.approx(0.05)
    unpaired = np.subtract(bootstrap_ci(after, seed=1), bootstrap_ci(before, seed=2)[::-1])
    assert unpaired[0] < 0 < unpaired[1]  # two separate intervals could not tell


def test_pass_intervals_per_domain():
    before = {"a1": 0.0, "a2": 0.5, "b1": 1.0}
    after = {"a1": 0.5, "a2": 0.5, "b1": 1.0, "extra": 1.0}  # a task on one side only is left out
    out = pass_intervals(before, after, {"a1": "a", "a2": "a", "b1": "b"})
    assert set(out) == {"all", "a", "b"}
    assert out["a"]["tasks"] == 2 and out["all"]["tasks"] == 3
    assert out["b"]["gain"] == [0.0, 0.0, 0.0]
    assert out["a"]["gain"][0] == pytest.approx(0.25)
