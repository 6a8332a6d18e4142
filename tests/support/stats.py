"""Goodness-of-fit tests for the sampling tests (no scipy): Pearson's chi-square against a law or between two
samples, judged against the Wilson–Hilferty approximation of the chi-square quantile."""

from __future__ import annotations

import math

import torch


def chi2_critical(df: int, z: float) -> float:
    """The chi-square quantile with ``df`` degrees of freedom at the normal quantile ``z`` (Wilson–Hilferty;
    z = 4.75 is alpha ≈ 1e-6)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_rejects(counts: torch.Tensor, p: torch.Tensor, z: float = 4.75) -> bool:
    """Whether counts ``[K]`` reject the law ``p [K]`` (cells with expected count < 5 pooled). The tests seed
    their samples, so the outcome is fixed, not flaky."""
    n = float(counts.sum())
    exp = p.double() * n
    big = exp >= 5
    obs = torch.cat([counts[big].double(), counts[~big].double().sum().reshape(1)])
    e = torch.cat([exp[big], exp[~big].sum().reshape(1)])
    keep = e > 0
    stat = float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum())
    return stat > chi2_critical(int(keep.sum()) - 1, z)


def two_sample_rejects(a: torch.Tensor, b: torch.Tensor, z: float = 4.75) -> bool:
    """Whether two count vectors come from different laws (cells with < 10 samples in both pooled)."""
    big = (a + b) >= 10
    a = torch.cat([a[big], a[~big].sum().reshape(1)]).double()
    b = torch.cat([b[big], b[~big].sum().reshape(1)]).double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = float(a.sum()), float(b.sum())
    stat = float((((a * math.sqrt(nb / na) - b * math.sqrt(na / nb)) ** 2) / (a + b)).sum())
    return stat > chi2_critical(int(keep.sum()) - 1, z)
