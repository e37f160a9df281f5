"""Scaling-law fits L(N) = a·N^−α + c and the share of N that DIFF needs (DIFF V1 §3.2, Fig 3).

DIFF V1 Fig 3 fits validation loss against model size N (Fig 3a) or training tokens D
(Fig 3b) with the law of Kaplan et al. (2020) plus an irreducible term, and reads off how much
N (or D) the DIFF Transformer needs to reach the Transformer's loss: 62.2% of the parameters
at 11B, 59.5% at 13.1B, 63.7% of the tokens at 251B.

The fit (:func:`fit_power_law`) is a bounded least-squares fit (``scipy.optimize.curve_fit``)
of ``L = a·(N/N₀)^−α + c`` with N₀ the geometric mean of the sizes (so the problem is well
scaled); ``a`` is reported in the original units, ``a·N₀^α``. Its starting point comes from a
variable-projection search: for a fixed α the law is linear in (a, c), so α is scanned on a
grid and (a, c) solved by least squares at each value. Parameter uncertainties are the square
roots of the covariance diagonal (curve_fit's, scaled by the residual variance); with as many
points as parameters the fit is exact and they are undefined.

:func:`share_needed` inverts a fitted law: the DIFF size whose predicted loss equals the
Transformer's at N_T is N_D = (a_D / (L_T(N_T) − c_D))^(1/α_D), and the share is N_D / N_T.
Its spread comes from sampling both fits' parameters from their covariances.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

PARAMETERS = ("a", "alpha", "c")
ALPHA_BOUNDS = (1e-3, 4.0)
"""Bounds of α: a loss that falls at least a little and not faster than N^−4."""


@dataclass
class PowerLawFit:
    """A fitted L(N) = a·N^−α + c (a in the units of N), with 1-σ uncertainties."""

    a: float
    alpha: float
    c: float
    a_err: float | None
    alpha_err: float | None
    c_err: float | None
    points: int
    rmse: float
    """Root mean squared residual of the loss, in nats."""
    scale: float
    """N₀, the geometric mean of the sizes the fit was made in (``a = a₀·N₀^α``)."""
    covariance: list[list[float]] | None
    """Covariance of (a₀, α, c) in the scaled problem; ``None`` when undefined."""
    at_bound: list[str]
    """Parameters that ended on a bound (the data do not pin them down)."""

    def predict(self, n: Any) -> Any:
        """Predicted loss at size(s) ``n``."""
        n = np.asarray(n, dtype=float)
        return self.a * n ** (-self.alpha) + self.c

    def size_at_loss(self, loss: float) -> float:
        """The N where the fitted loss equals ``loss`` (``inf`` when ``loss <= c``)."""
        return _invert(self.a, self.alpha, self.c, loss)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _law(x: np.ndarray, a0: float, alpha: float, c: float) -> np.ndarray:
    return a0 * x ** (-alpha) + c


def _invert(a: float, alpha: float, c: float, loss: float) -> float:
    if loss <= c or a <= 0:
        return math.inf
    return (a / (loss - c)) ** (1.0 / alpha)


def _check_points(sizes: Sequence[float], losses: Sequence[float], what: str):
    n = np.asarray(sizes, dtype=float)
    loss = np.asarray(losses, dtype=float)
    if n.ndim != 1 or n.shape != loss.shape:
        raise ValueError(f"{what}: sizes and losses must be two lists of the same length")
    if len(n) < len(PARAMETERS):
        raise ValueError(
            f"{what}: {len(n)} point(s) cannot fit the {len(PARAMETERS)} parameters of "
            "L = a·N^−α + c; give at least 3 sizes (or token counts)"
        )
    if not (np.isfinite(n).all() and np.isfinite(loss).all()):
        raise ValueError(f"{what}: sizes and losses must be finite numbers")
    if (n <= 0).any():
        raise ValueError(f"{what}: sizes must be positive, got {n.tolist()}")
    if len(np.unique(n)) < len(PARAMETERS):
        raise ValueError(
            f"{what}: needs at least 3 distinct sizes, got {len(np.unique(n))} "
            f"({sorted(set(n.tolist()))})"
        )
    return n, loss


def _start(x: np.ndarray, loss: np.ndarray) -> tuple[float, float, float]:
    """Variable projection: best (a₀, α, c) over an α grid, (a₀, c) by least squares,
    with a₀ ≥ 0 and 0 ≤ c ≤ min(loss)."""
    best = None
    for alpha in np.geomspace(0.01, ALPHA_BOUNDS[1], 200):
        design = np.stack([x ** (-alpha), np.ones_like(x)], axis=1)
        (a0, c), *_ = np.linalg.lstsq(design, loss, rcond=None)
        a0 = max(float(a0), 1e-12)
        c = min(max(float(c), 0.0), float(loss.min()))
        error = float(np.sum((_law(x, a0, alpha, c) - loss) ** 2))
        if best is None or error < best[0]:
            best = (error, a0, float(alpha), c)
    assert best is not None
    return best[1], best[2], best[3]


def fit_power_law(
    sizes: Sequence[float], losses: Sequence[float], what: str = "fit"
) -> PowerLawFit:
    """Fit L(N) = a·N^−α + c to ``(sizes, losses)`` (DIFF V1 Fig 3, after Kaplan et al.).

    Bounds: a ≥ 0, α in :data:`ALPHA_BOUNDS`, 0 ≤ c ≤ min(loss).

    Raises:
        ValueError: fewer than 3 (distinct) points, non-finite or non-positive values, or a
            fit that does not converge (``what`` names the series in the message).
    """
    from scipy.optimize import OptimizeWarning, curve_fit

    n, loss = _check_points(sizes, losses, what)
    scale = float(np.exp(np.mean(np.log(n))))
    x = n / scale
    p0 = _start(x, loss)
    upper_c = float(loss.min())
    lower = (0.0, ALPHA_BOUNDS[0], 0.0)
    upper = (np.inf, ALPHA_BOUNDS[1], upper_c)
    p0 = tuple(min(max(v, lo), hi) for v, lo, hi in zip(p0, lower, upper, strict=True))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", OptimizeWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            params, cov = curve_fit(
                _law, x, loss, p0=p0, bounds=(lower, upper), maxfev=20_000, method="trf"
            )
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{what}: the fit of L = a·N^−α + c did not converge ({error})") from None
    a0, alpha, c = (float(v) for v in params)
    residual = _law(x, a0, alpha, c) - loss
    if not np.isfinite(residual).all():
        raise ValueError(f"{what}: the fit of L = a·N^−α + c did not converge (non-finite fit)")
    rmse = float(np.sqrt(np.mean(residual**2)))
    cov = np.asarray(cov, dtype=float)
    defined = len(n) > len(PARAMETERS) and np.isfinite(cov).all()
    errors: list[float | None] = [None, None, None]
    if defined:
        sd = np.sqrt(np.clip(np.diag(cov), 0.0, None))
        # a = a0 · scale^α: first-order propagation of (a0, α) to a
        a = a0 * scale**alpha
        grad = np.array([scale**alpha, a * math.log(scale), 0.0])
        errors = [float(math.sqrt(max(grad @ cov @ grad, 0.0))), float(sd[1]), float(sd[2])]
    tolerance = 1e-6
    at_bound = [
        name
        for name, value, lo, hi in zip(PARAMETERS, (a0, alpha, c), lower, upper, strict=True)
        if abs(value - lo) <= tolerance * max(1.0, abs(lo))
        or (math.isfinite(hi) and abs(value - hi) <= tolerance * max(1.0, abs(hi)))
    ]
    return PowerLawFit(
        a=a0 * scale**alpha,
        alpha=alpha,
        c=c,
        a_err=errors[0],
        alpha_err=errors[1],
        c_err=errors[2],
        points=len(n),
        rmse=rmse,
        scale=scale,
        covariance=cov.tolist() if defined else None,
        at_bound=at_bound,
    )


@dataclass
class Share:
    """How much N (or D) DIFF needs to match the Transformer at one reference size."""

    reference: float
    """The Transformer's N_T (or the DIFF model's N_D when ``direction`` is ``diff``)."""
    direction: str
    """``transformer``: N_T given, N_D solved; ``diff``: N_D given, N_T solved (the paper's
    "6.8B DIFF matches an 11B Transformer")."""
    transformer: float
    diff: float
    share: float
    """N_D / N_T (``inf`` when DIFF's fitted floor c lies above the Transformer's loss)."""
    low: float | None = None
    high: float | None = None
    """16th and 84th percentiles of the share over sampled fit parameters."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def share_needed(
    transformer: PowerLawFit,
    diff: PowerLawFit,
    reference: float,
    direction: str = "transformer",
    samples: int = 2000,
    seed: int = 0,
) -> Share:
    """The share N_D / N_T at which the two fitted laws give the same loss.

    ``direction="transformer"``: N_T = ``reference``, N_D = L_D⁻¹(L_T(N_T)).
    ``direction="diff"``: N_D = ``reference``, N_T = L_T⁻¹(L_D(N_D)) (as the paper states
    its 62.2% and 59.5%). The 16–84% band samples both fits' parameters from their
    covariances (independent fits); it is absent when either covariance is undefined.
    """
    if direction not in ("transformer", "diff"):
        raise ValueError(f"direction must be 'transformer' or 'diff', got {direction!r}")
    if not reference > 0:
        raise ValueError(f"reference size must be positive, got {reference}")

    def solve(ft: tuple[float, float, float], fd: tuple[float, float, float]) -> float:
        if direction == "transformer":
            n_d = _invert(*fd, ft[0] * reference ** (-ft[1]) + ft[2])
            return n_d / reference
        n_t = _invert(*ft, fd[0] * reference ** (-fd[1]) + fd[2])
        return reference / n_t if n_t > 0 else math.inf

    point_t = (transformer.a, transformer.alpha, transformer.c)
    point_d = (diff.a, diff.alpha, diff.c)
    share = solve(point_t, point_d)
    if direction == "transformer":
        n_t, n_d = reference, share * reference
    else:
        n_d = reference
        n_t = reference / share if share > 0 else math.inf
    result = Share(reference, direction, n_t, n_d, share)
    if transformer.covariance is None or diff.covariance is None or not math.isfinite(share):
        return result
    rng = np.random.default_rng(seed)
    draws_t = _sample(transformer, rng, samples)
    draws_d = _sample(diff, rng, samples)
    values = np.array([solve(t, d) for t, d in zip(draws_t, draws_d, strict=True)])
    values = values[np.isfinite(values)]
    if len(values) >= samples // 2:
        result.low, result.high = (float(v) for v in np.percentile(values, [16, 84]))
    return result


def _sample(fit: PowerLawFit, rng: np.random.Generator, count: int) -> list[tuple]:
    """Parameter draws (a, α, c) in original units from the scaled fit's covariance."""
    a0 = fit.a * fit.scale ** (-fit.alpha)
    mean = np.array([a0, fit.alpha, fit.c])
    draws = rng.multivariate_normal(mean, np.asarray(fit.covariance), size=count)
    out = []
    for a0_i, alpha_i, c_i in draws:
        if a0_i > 0 and alpha_i > 0:
            out.append((a0_i * fit.scale**alpha_i, alpha_i, c_i))
        else:
            out.append((math.nan, math.nan, math.nan))
    return out


__all__ = ["ALPHA_BOUNDS", "PARAMETERS", "PowerLawFit", "Share", "fit_power_law", "share_needed"]
