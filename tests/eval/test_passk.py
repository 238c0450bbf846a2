import itertools
import math

import pytest

from tempering.eval.passk import pass_at_k


def brute_force(n, c, k):
    """Fraction of k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 1, 5), (6, 6, 2), (7, 3, 4)])
def test_matches_brute_force(n, c, k):
    assert math.isclose(pass_at_k(n, c, k), brute_force(n, c, k), rel_tol=1e-9)


def test_pass_at_1_is_the_fraction_correct():
    assert math.isclose(pass_at_k(10, 3, 1), 0.3)


def test_k_larger_than_n_is_an_error():
    with pytest.raises(ValueError, match="at least 5 samples"):
        pass_at_k(2, 1, 5)
