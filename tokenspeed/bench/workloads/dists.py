"""Seeded distributions of the workload specs (workloads.md): lognormals given as (median, mean), mixtures, caps."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LogNormal:
    """Lognormal given by its median and mean: mu = ln(median), sigma = sqrt(2 ln(mean / median)).

    `lo` / `hi` clamp the samples (None: no clamp). Units are those of the caller (tokens, seconds, turns).
    """

    median: float
    mean: float
    lo: float | None = None
    hi: float | None = None

    @classmethod
    def from_sigma(cls, median: float, sigma: float, lo: float | None = None, hi: float | None = None) -> LogNormal:
        """Lognormal given by its median and sigma (mean = median * exp(sigma^2 / 2))."""
        return cls(median, median * math.exp(sigma * sigma / 2.0), lo, hi)

    @property
    def mu(self) -> float:
        return math.log(self.median)

    @property
    def sigma(self) -> float:
        return math.sqrt(2.0 * math.log(self.mean / self.median)) if self.mean > self.median else 0.0

    def sample(self, rng: np.random.Generator, size: int | None = None) -> np.ndarray | float:
        """`size` samples (an array), or one float when size is None."""
        x = rng.lognormal(self.mu, self.sigma, size)
        if size is None:
            x = float(x)
            x = x if self.lo is None else max(self.lo, x)
            return x if self.hi is None else min(self.hi, x)
        if self.lo is not None or self.hi is not None:
            x = np.clip(x, self.lo, self.hi)
        return x

    def cdf(self, x: float) -> float:
        """P(X <= x) of the unclamped lognormal."""
        if self.sigma == 0:
            return float(x >= self.median)
        return 0.5 * (1.0 + math.erf((math.log(x) - self.mu) / (self.sigma * math.sqrt(2.0))))


@dataclass(frozen=True)
class Mixture:
    """Pick component i with probability weights[i] (weights sum to 1)."""

    weights: tuple[float, ...]
    parts: tuple[LogNormal, ...]

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        which = rng.choice(len(self.parts), size=size, p=self.weights)
        out = np.empty(size)
        for i, part in enumerate(self.parts):
            mask = which == i
            out[mask] = part.sample(rng, int(mask.sum()))
        return out


def scaled(tokens: float | np.ndarray, scale: float, lo: int = 1) -> np.ndarray | int:
    """Token counts times the --scale factor, rounded, at least `lo`."""
    if isinstance(tokens, (int, float)):
        return max(lo, int(round(tokens * scale)))
    x = np.maximum(np.rint(np.asarray(tokens, dtype=float) * scale), lo).astype(np.int64)
    return int(x) if x.ndim == 0 else x


def session_rng(seed: int, session: int, stream: int = 0) -> np.random.Generator:
    """Independent generator per (seed, session): session i is the same whatever the pool size."""
    return np.random.default_rng([seed, session, stream])
