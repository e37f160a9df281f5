"""Streaming reductions: statistics of a stream of tensors in constant memory.

:class:`RunningStats` keeps, for the absolute values it is fed, the count, sum, sum of squares,
maximum, the ``top_k`` largest values and a histogram on fixed log-spaced bins from which
quantiles such as the median are read (to within one bin: the default 2,048 bins over
[1e-8, 1e8] are 1.8% wide). DIFF V1 Table 5 reports exactly these figures of attention logits
and hidden states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class RunningStats:
    """Statistics of ``|x|`` over everything passed to :meth:`update`.

    Attributes:
        top_k: how many of the largest values to keep.
        bins: histogram bins, log-spaced over ``[low, high]``; values below ``low`` fall in the
            first bin, above ``high`` in the last.
    """

    top_k: int = 100
    bins: int = 2048
    low: float = 1e-8
    high: float = 1e8
    count: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    maximum: float = 0.0
    top: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.float64))
    histogram: torch.Tensor | None = None

    def update(self, values: torch.Tensor) -> None:
        """Add the absolute values of ``values`` (any shape; pass only the valid entries)."""
        flat = values.detach().reshape(-1).abs().float()
        if flat.numel() == 0:
            return
        self.count += flat.numel()
        self.total += float(flat.double().sum())
        self.total_sq += float(flat.double().square().sum())
        self.maximum = max(self.maximum, float(flat.max()))
        k = min(self.top_k, flat.numel())
        if k > 0:
            best = torch.topk(flat, k).values.double().cpu()
            merged = torch.cat([self.top, best])
            self.top = torch.topk(merged, min(self.top_k, merged.numel())).values
        index = self._bin(flat)
        counts = torch.bincount(index, minlength=self.bins).cpu().double()
        self.histogram = counts if self.histogram is None else self.histogram + counts

    def _bin(self, flat: torch.Tensor) -> torch.Tensor:
        lo, hi = math.log(self.low), math.log(self.high)
        position = (torch.log(flat.clamp_min(self.low)) - lo) / (hi - lo) * self.bins
        return position.long().clamp(0, self.bins - 1)

    def _edges(self) -> torch.Tensor:
        return torch.logspace(
            math.log10(self.low), math.log10(self.high), self.bins + 1, dtype=torch.float64
        )

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of ``|x|`` read off the histogram (geometric bin midpoint)."""
        if self.histogram is None or self.count == 0:
            return math.nan
        cumulative = torch.cumsum(self.histogram, 0)
        index = int(torch.searchsorted(cumulative, torch.tensor(q * self.count).double()))
        index = min(index, self.bins - 1)
        edges = self._edges()
        return float(torch.sqrt(edges[index] * edges[index + 1]))

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    @property
    def std(self) -> float:
        if not self.count:
            return math.nan
        return math.sqrt(max(self.total_sq / self.count - self.mean**2, 0.0))

    def top_values(self, k: int) -> float:
        """The ``k``-th largest value seen (1-based), NaN when fewer were seen."""
        return float(self.top[k - 1]) if self.top.numel() >= k else math.nan

    def summary(self, ranks: tuple[int, ...] = (1, 2, 3, 10, 100)) -> dict[str, float]:
        """Top-k values at ``ranks``, median, mean, std, max and count (DIFF Table 5 style)."""
        out = {f"top{r}": self.top_values(r) for r in ranks if r <= self.top_k}
        out.update(
            median=self.quantile(0.5),
            mean=self.mean,
            std=self.std,
            max=self.maximum,
            count=float(self.count),
        )
        return out
