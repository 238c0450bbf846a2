"""The unbiased pass@k estimator (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
arXiv 2107.03374): with n samples of which c pass, pass@k = 1 - C(n - c, k) / C(n, k)."""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) passes."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    # Product form of 1 - C(n-c, k)/C(n, k): numerically stable for large n.
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
