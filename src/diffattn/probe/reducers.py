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

    def update(self, values: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Add ``|values|`` (any shape). ``valid``, a bool mask broadcastable to ``values``,
        keeps only the entries it marks (without gathering them into a copy)."""
        flat = values.detach().float().abs()  # one copy, reused in place below
        n_invalid = 0
        if valid is not None:
            repeats = flat.numel() // valid.numel()  # valid is broadcast by repetition
            n_invalid = flat.numel() - int(valid.sum()) * repeats
            flat.masked_fill_(~valid.expand_as(flat), 0.0)  # zeros change no sum, max or top
        flat = flat.reshape(-1)
        if flat.numel() == n_invalid:
            return
        self.count += flat.numel() - n_invalid
        self.total += float(flat.sum(dtype=torch.float64))
        self.total_sq += float(torch.linalg.vector_norm(flat, dtype=torch.float64)) ** 2
        self.maximum = max(self.maximum, float(flat.max()))
        candidates = flat
        if self.top.numel() == self.top_k:  # only values above the current k-th can enter
            candidates = flat[flat > float(self.top[-1])]
        k = min(self.top_k, candidates.numel())
        if k > 0:
            best = torch.topk(candidates, k, sorted=False).values.double().cpu()
            merged = torch.cat([self.top, best])
            self.top = torch.topk(merged, min(self.top_k, merged.numel())).values
        lo, hi = math.log(self.low), math.log(self.high)
        flat.clamp_(self.low, self.high).log_()
        counts = torch.histc(flat, bins=self.bins, min=lo, max=hi).cpu().double()
        counts[0] -= n_invalid  # the masked entries were zeros, counted in the lowest bin
        self.histogram = counts if self.histogram is None else self.histogram + counts

    @classmethod
    def merged(cls, parts: list[RunningStats], top_k: int | None = None) -> RunningStats:
        """One :class:`RunningStats` of everything the ``parts`` saw (same bins)."""
        out = cls(top_k=top_k or max((p.top_k for p in parts), default=100))
        for part in parts:
            if part.count == 0:
                continue
            out.count += part.count
            out.total += part.total
            out.total_sq += part.total_sq
            out.maximum = max(out.maximum, part.maximum)
            merged = torch.cat([out.top, part.top])
            out.top = torch.topk(merged, min(out.top_k, merged.numel())).values
            hist = part.histogram
            out.histogram = hist.clone() if out.histogram is None else out.histogram + hist
        return out

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
