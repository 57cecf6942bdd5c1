"""A score's distribution, merged from pieces in any order: exact while small, a sketch after.

``Scores`` keeps a score's count, sum, min and max exactly. Its quantiles are exact
(numpy's linear interpolation over every value) while it holds at most ``EXACT_LIMIT``
values; past that it keeps a relative-error sketch instead, in the manner of DDSketch
(Masson, Rim and Lee, VLDB 2019): each value counts in the bucket of its magnitude on a
log scale of base ``GAMMA``, so every quantile it reports is within ``RELATIVE_ERROR``
of a value that holds that rank, and two sketches merge by adding counts. Buckets are
a function of the values alone, so the result does not depend on how the pieces were
split or in which order they merged: the same run gives the same figures.

The rule people read (``docs/output.md``): up to ``EXACT_LIMIT`` scored images, the
quantiles are exact; above, each is within 0.1% (relative) of the true one, with
count, mean, min and max still exact.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

EXACT_LIMIT = 100_000  # values kept exactly per score: 800 KB
RELATIVE_ERROR = 0.001
GAMMA = (1 + RELATIVE_ERROR) / (1 - RELATIVE_ERROR)
TINY = 1e-12  # magnitudes below this count as zero


def _bucket_keys(values: np.ndarray) -> np.ndarray:
    return np.ceil(np.log(values) / math.log(GAMMA)).astype(np.int64)


@dataclasses.dataclass
class Scores:
    """One score's values, summarised (see the module's docstring)."""
    count: int = 0
    total: float = 0.0
    low: float = math.inf
    high: float = -math.inf
    exact: list = dataclasses.field(default_factory=list)  # arrays of values, while count <= EXACT_LIMIT
    positive: dict = dataclasses.field(default_factory=dict)  # bucket -> count, once past EXACT_LIMIT
    negative: dict = dataclasses.field(default_factory=dict)
    zeros: int = 0

    @property
    def sketched(self) -> bool:
        return self.count > EXACT_LIMIT

    def add(self, values) -> "Scores":
        """Fold in an array of values; returns self."""
        values = np.asarray(values, np.float64)
        if not len(values):
            return self
        self.count += len(values)
        self.total += float(values.sum())
        self.low, self.high = min(self.low, float(values.min())), max(self.high, float(values.max()))
        self.exact.append(values)
        if self.sketched:
            self._to_sketch()
        return self

    def merge(self, other: "Scores") -> "Scores":
        """Fold in another summary; returns self."""
        self.count += other.count
        self.total += other.total
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)
        self.exact += other.exact
        for mine, theirs in ((self.positive, other.positive), (self.negative, other.negative)):
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        self.zeros += other.zeros
        if self.sketched:
            self._to_sketch()
        return self

    def _to_sketch(self) -> None:
        for values in self.exact:
            self.zeros += int(np.sum(np.abs(values) < TINY))
            for store, part in ((self.positive, values[values >= TINY]), (self.negative, -values[values <= -TINY])):
                keys, counts = np.unique(_bucket_keys(part), return_counts=True)
                for key, n in zip(keys.tolist(), counts.tolist()):
                    store[key] = store.get(key, 0) + n
        self.exact = []

    def quantiles(self, qs) -> list[float]:
        """The values at quantiles ``qs``: exact (linear interpolation) or sketched."""
        if not self.sketched:
            return [float(v) for v in np.quantile(np.concatenate(self.exact), qs)]
        # ascending: the negative buckets from the largest magnitude, the zeros, the positive ones
        order = [(-_value(k), n) for k, n in sorted(self.negative.items(), reverse=True)]
        order += [(0.0, self.zeros)] if self.zeros else []
        order += [(_value(k), n) for k, n in sorted(self.positive.items())]
        found = []
        for q in qs:
            rank, seen = q * (self.count - 1), 0
            for value, n in order:
                seen += n
                if seen > rank:
                    found.append(min(max(value, self.low), self.high))
                    break
        return found

    def summary(self, qs, names) -> dict:
        """stats.json's entry for the score: count, mean, min, quantiles by name, max, and
        whether the quantiles are exact."""
        return {"count": self.count, "mean": round(self.total / self.count, 6), "min": round(self.low, 6),
                "quantiles": {name: round(v, 6) for name, v in zip(names, self.quantiles(qs))},
                "max": round(self.high, 6), "quantiles_exact": not self.sketched}


def _value(key: int) -> float:
    """The value a bucket stands for: within RELATIVE_ERROR of every magnitude in it."""
    return 2 * GAMMA ** key / (GAMMA + 1)
